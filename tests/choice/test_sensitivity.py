"""The sensitivity search: the node whose quantization hurts gets float activations, and only that."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.options import SearchOptions
from tests.conftest import calib_dir, eval_dir, run_model, sample

# block1/conv's input range clipped at its 60th percentile: one badly quantized layer in a good model
DAMAGE = "node_name: {block1/conv: {activation: {observer: {name: percentile, percentile: 60}}}}\n"
# without timing the choice keeps the search's placement whenever it reaches the target (deterministic)
DAMAGED = DAMAGE + "accuracy: {latency_runs: 0}\n"


def sqnr(model, candidate, name="cnn") -> float:
    num = den = 0.0
    for path in sorted(eval_dir(name).glob("*.npy"))[:16]:
        x = np.load(path)[None]
        r, c = run_model(model, {"input": x})[0], run_model(candidate, {"input": x})[0]
        num, den = num + float((r**2).sum()), den + float(((r - c) ** 2).sum())
    return 10 * np.log10(num / den)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damaged")
    config = folder / "c.yaml"
    config.write_text(DAMAGED)
    plain, searched = folder / "plain.onnx", folder / "searched.onnx"
    qtool.quantize(sample("cnn"), plain, data_dir=calib_dir("cnn"), config_path=config, search=None, evaluation=None)
    result = qtool.quantize(sample("cnn"), searched, data_dir=calib_dir("cnn"), config_path=config, evaluation=None)
    return config, plain, searched, result


def test_search_gives_the_damaged_layer_float_activations_and_recovers_accuracy(damaged):
    _, plain, searched, result = damaged
    before, after = sqnr(sample("cnn"), plain), sqnr(sample("cnn"), searched)
    assert before < 25 and after > before + 8, (before, after)
    f = result.search
    assert f is not None and f.kept_nodes == ["block1/conv"] and f.reached
    assert f.final_sqnr_db >= 30 > f.initial_sqnr_db
    assert all(not step.kept for step in f.steps if step.node != "block1/conv")  # tried, no gain, quantized again
    # block1/conv and the head compute in float; a neighbour left alone between float nodes may follow it
    assert result.placements.get("storage", 0) >= 2 and sum(result.placements.values()) == 4
    # its weights stay stored as int8: the file is as small as before
    assert sample("cnn").stat().st_size / searched.stat().st_size > 3.5
    model = onnx.load(str(searched))
    stored = {i.name: i.data_type for i in model.graph.initializer}
    assert stored["block1.conv.weight/quantized"] == onnx.TensorProto.INT8


def test_search_is_deterministic_and_reported_in_json(damaged, tmp_path):
    config, _, searched, _ = damaged
    out = tmp_path / "again.onnx"
    r = CliRunner().invoke(
        app,
        [
            *("quantize", str(sample("cnn")), "--data", str(calib_dir("cnn")), "-c", str(config), "-o", str(out)),
            *("--runs", "0", "--json", "-"),
        ],
    )
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes() == searched.read_bytes()
    report = json.loads(r.stdout)["sensitivity"]
    assert report["float_activation_nodes"] == ["block1/conv"] and report["reached"] is True
    assert [s["node"] for s in report["steps"] if s["kept"]] == ["block1/conv"] and report["target_sqnr_db"] == 30
    # ranked by decibels per millisecond: each move's latency estimated, from the candidates' timings or the MACs
    assert report["ranked_by"].startswith("dB per ms lost, from ")
    assert all(s["cost_ms"] is not None and s["cost_ms"] > 0 for s in report["steps"])


def test_search_is_off_with_no_search_with_null_target_and_without_samples(damaged, tmp_path):
    config, plain, _, _ = damaged
    off = tmp_path / "off.yaml"
    off.write_text(DAMAGE + "accuracy: {target_sqnr_db: null}\n")
    out = tmp_path / "q.onnx"
    result = qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), config_path=off, evaluation=None)
    assert result.search is None and out.read_bytes() == plain.read_bytes()
    stats = tmp_path / "s.json"
    qtool.write_stats(qtool.calibrate(sample("cnn"), calib_dir("cnn"), config_path=config), stats)
    result = qtool.quantize(sample("cnn"), out, stats_path=stats, config_path=config, evaluation=None)
    # without samples nothing is measured: no search, and no integer kernel guessed in (fp32 speed), said so
    assert result.search is None and "integer" not in result.placements
    assert any("no samples to measure the placement" in note for note in result.notes)
    # --stats with --search-data searches again
    result = qtool.quantize(
        sample("cnn"),
        out,
        stats_path=stats,
        config_path=config,
        search=SearchOptions(data_dir=calib_dir("cnn")),
        evaluation=None,
    )
    assert result.search is not None and result.search.kept_nodes == ["block1/conv"]


def test_accuracy_section_is_validated(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("accuracy:\n  target_sqnr_db: 30\n  max_float_nodes: 0\n")
    r = CliRunner().invoke(
        app,
        [
            "quantize",
            str(sample("cnn")),
            "--data",
            str(calib_dir("cnn")),
            "-c",
            str(config),
            "-o",
            str(tmp_path / "q.onnx"),
        ],
    )
    assert r.exit_code == 2 and f"{config}:3:" in r.stderr and "positive integer" in r.stderr
    r = CliRunner().invoke(
        app,
        [
            "quantize",
            str(sample("cnn")),
            "--data",
            str(calib_dir("cnn")),
            "--max-float-nodes",
            "0",
            "-o",
            str(tmp_path / "q.onnx"),
        ],
    )
    assert r.exit_code == 2 and "--max-float-nodes" in r.stderr  # 0 is refused, not read as "use the default"
    config.write_text("accuracy: {target_sqnr_db: high}\n")
    r = CliRunner().invoke(app, ["inspect", str(sample("cnn")), "-c", str(config)])
    assert r.exit_code == 2 and "target_sqnr_db" in r.stderr and not (tmp_path / "q.onnx").exists()
