"""What a newcomer types first: mix-ups are one clear line, flags work where the README says, configs by name."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, sample

runner = CliRunner()
CNN, CALIB = sample("cnn"), calib_dir("cnn")


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("first-hour") / "cnn.stats.json"
    r = runner.invoke(app, ["calibrate", str(CNN), str(CALIB), "-o", str(path), "--limit", "8"])
    assert r.exit_code == 0, r.output
    return path


@pytest.mark.parametrize("command", ["inspect", "quantize", "compare", "calibrate"])
def test_a_statistics_file_given_as_the_model_is_named_for_what_it_is(tmp_path, stats_file, command):
    args = {
        "inspect": ["inspect", stats_file],
        "quantize": ["quantize", stats_file, "--data", CALIB, "-o", tmp_path / "q.onnx"],
        "compare": ["compare", stats_file, CNN, "--data", CALIB],
        "calibrate": ["calibrate", stats_file, CALIB, "-o", tmp_path / "s.json"],
    }[command]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    assert "is not an ONNX model: it looks like qtool statistics (JSON)" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "s.json").exists()


@pytest.mark.parametrize(
    ("suffix", "text", "kind"),
    [
        (".json", '{"a": 1}', "a JSON file"),
        (".textproto", "ir_version: 8\n", "textproto"),
        (".onnx", "global:\n", "YAML"),
    ],
)
def test_text_files_of_any_extension_are_refused_as_models(tmp_path, suffix, text, kind):
    path = tmp_path / f"model{suffix}"
    path.write_text(text)
    r = runner.invoke(app, ["inspect", str(path)])
    assert r.exit_code == 2 and kind in r.output and "Traceback" not in r.output, r.output


def test_a_real_model_named_json_still_loads(tmp_path):
    renamed = tmp_path / "model.json"
    renamed.write_bytes(CNN.read_bytes())
    r = runner.invoke(app, ["inspect", str(renamed), "--json", "-"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["nodes"]) >= 4


def test_global_flags_work_after_the_command_too(tmp_path):
    quiet = runner.invoke(app, ["inspect", str(CNN), "-q"])
    assert quiet.exit_code == 0 and quiet.stdout == "", quiet.output
    verbose = runner.invoke(app, ["inspect", str(CNN), "-v"])
    assert verbose.exit_code == 0 and "INFO: load" in verbose.output
    both = runner.invoke(app, ["inspect", str(CNN), "--quiet", "--verbose"])
    assert both.exit_code == 2 and "contradict" in both.output


def test_every_command_takes_json(tmp_path, stats_file):
    merged = tmp_path / "merged.json"
    r = runner.invoke(app, ["merge", str(stats_file), "-o", str(merged), "--json", "-"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    # the sample CNN: its activations but the logits, which its last Gemm writes in float
    assert summary["stats_path"] == str(merged) and summary["tensors"] == 8
    r = runner.invoke(app, ["schema", "config", "--json", "-"])
    assert r.exit_code == 0 and json.loads(r.stdout)["$id"] == "qtool:config"
    r = runner.invoke(app, ["configs", "--json", "-"])
    names = [row["name"] for row in json.loads(r.stdout)["configs"]]
    assert {"accurate", "default", "dynamic", "integer"} <= set(names)


def test_bare_qtool_prints_the_help_as_lines():
    done = subprocess.run([sys.executable, "-m", "qtool"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: ") and "\\n" not in done.stdout and "\n  calibrate " in done.stdout


def test_installed_configs_are_addressable_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no accurate.yaml here: the installed one
    r = runner.invoke(app, ["inspect", str(CNN), "--config", "accurate", "--json", "-"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["inspect", str(CNN), "--config", "nosuchconfig"])
    assert r.exit_code == 2 and "or name an installed config: accurate" in r.output


def test_stats_without_samples_never_guesses_integer_kernels_in_silently(tmp_path, stats_file):
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(CNN), "--stats", str(stats_file), "-o", str(out), "--json", "-"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert "integer" not in report["placements"]
    assert any("no samples to measure the placement" in note for note in report["notes"])
    assert "fp32 speed" in r.stderr


def test_input_shapes_on_an_input_without_any_shape(tmp_path):
    model = onnx.load(str(CNN))
    model.graph.input[0].type.tensor_type.ClearField("shape")
    source = tmp_path / "noshape.onnx"
    onnx.save(model, source)
    name = model.graph.input[0].name
    out = tmp_path / "q.onnx"
    args = ["quantize", str(source), "--data", str(CALIB), "--input-shapes", f"{name}:1x3x32x32", "-o", str(out)]
    r = runner.invoke(app, [*args, "--latency-runs", "0"])
    assert r.exit_code == 0, r.output
    written = onnx.load(str(out))
    onnx.checker.check_model(written)
    assert len(written.graph.input[0].type.tensor_type.shape.dim) == 4


def test_images_without_a_preprocess_block_say_what_was_applied(tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for i in range(2):
        Image.new("RGB", (40, 48), (10 * i, 20, 30)).save(images / f"{i}.png")
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "calibrate", str(CNN), str(images), "-o", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "no preprocess: block in the config" in done.stderr and "resized to 32x32" in done.stderr
    assert "pixels scaled by 0.00392157, no mean or std" in done.stderr


def test_a_fixed_batch_model_says_how_to_shape_its_samples(tmp_path):
    import numpy as np

    model = onnx.load(str(CNN))
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_value = 4
    fixed = tmp_path / "batch4.onnx"
    onnx.save(model, fixed)
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.zeros((1, 3, 32, 32), np.float32))
    r = runner.invoke(app, ["calibrate", str(fixed), str(data), "-o", str(tmp_path / "s.json")])
    assert r.exit_code == 2, r.output
    assert "has a fixed batch of 4, the sample holds 1" in r.output and "[4, 3, 32, 32]" in r.output


def test_inspect_shows_what_quantize_writes_and_says_how_the_placement_is_decided(tmp_path, stats_file):
    out = tmp_path / "q.onnx"
    q = runner.invoke(app, ["quantize", str(CNN), "--stats", str(stats_file), "-o", str(out), "--json", "-"])
    assert q.exit_code == 0, q.output
    written = json.loads(q.stdout)
    i = runner.invoke(app, ["inspect", str(CNN), "--json", "-"])
    inspected = json.loads(i.stdout)
    placements: dict[str, int] = {}
    for node in inspected["nodes"]:
        placements[node["placement"]] = placements.get(node["placement"], 0) + 1
    assert placements == written["placements"]
    assert inspected["totals"]["predicted_model_bytes"] == out.stat().st_size
    assert "as quantize writes it without samples" in inspected["placement_note"]
    measured = json.loads(runner.invoke(app, ["inspect", str(CNN), "--data", str(CALIB), "--json", "-"]).stdout)
    assert "quantize --data measures the candidate placements" in measured["placement_note"]


def test_inspect_fits_80_columns_without_cutting_a_number():
    from rich.console import Console

    import qtool
    from qtool.reports.tables import render_inspection

    result = qtool.inspect(sample("transformer"))
    console = Console(width=80, record=True, force_terminal=False)
    render_inspection(console, result)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for row in result.rows:
        for number in (row.weight_elements, row.float_bytes, row.quantized_bytes):
            assert f"{number:,}" in text, number
    assert "…" not in text


@pytest.mark.parametrize("command", ["quantize", "compare", "calibrate", "tune"])
def test_help_is_grouped_by_topic_and_lists_every_option_once(command):
    r = runner.invoke(app, [command, "--help"])
    assert r.exit_code == 0, r.output
    sections = [line for line in r.output.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert "Inputs:" in sections and "Outputs:" in sections and "Options:" not in sections, sections
    click_command = __import__("typer").main.get_command(app).commands[command]
    for param in click_command.params:
        for name in param.opts:
            if name.startswith("--"):
                assert r.output.count(f"{name} ") + r.output.count(f"{name},") + r.output.count(f"{name}\n") >= 1, name


def test_many_nodes_kept_float_for_one_reason_take_one_line():
    from qtool.reports.tables import grouped_by_reason

    pairs = [(f"/m/Gather_{i}", "not a lookup in a constant table") for i in range(54)]
    pairs.insert(3, ("head/gemm", "kept in float by the config"))
    lines = grouped_by_reason(pairs)
    assert lines == [
        ("54 nodes (/m/Gather_0, /m/Gather_1, ...)", "not a lookup in a constant table"),
        ("head/gemm", "kept in float by the config"),
    ]
    few = [("a", "why"), ("b", "why")]
    assert grouped_by_reason(few) == few  # a handful stay one line each
