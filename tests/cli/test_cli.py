"""The three commands through the CLI: outputs, exit codes and one-line error messages."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, eval_dir, sample

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *fragments: str, code: int = 2) -> None:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_calibrate_quantize_compare_end_to_end(tmp_path):
    stats = tmp_path / "stats.json"
    out = tmp_path / "cnn.int8.onnx"
    r = invoke("calibrate", sample("cnn"), calib_dir("cnn"), "-o", stats, "--limit", "32")
    assert r.exit_code == 0, r.stderr
    data = json.loads(stats.read_text())
    assert data["format"] == "qtool-calibration-stats" and data["version"] == 1
    assert data["samples"] == 32 and data["observer"] == "mse" and len(data["model_sha256"]) == 64
    assert all(set(t["state"]) == {"histogram", "min", "max"} for t in data["tensors"].values())

    r = invoke("quantize", sample("cnn"), "--stats", stats, "-o", out)
    assert r.exit_code == 0, r.stderr
    assert "compression" in r.stdout
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)

    r = invoke(
        "compare",
        sample("cnn"),
        out,
        "--data",
        eval_dir("cnn"),
        "--runs",
        "3",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--json",
        "-",
    )
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["schema_version"] == 3
    assert report["size"]["candidate_bytes"] == out.stat().st_size
    assert report["size"]["compression_ratio"] == pytest.approx(sample("cnn").stat().st_size / out.stat().st_size)
    assert report["accuracy"]["overall"]["sqnr_db"] > 25
    (latency,) = report["latency"]
    assert latency["threads"] == 1 and latency["reference"]["runs"] == 3
    assert report["reproducibility"]["reference_sha256"] == report["models"]["reference"]["sha256"]
    assert "SQNR" in r.stderr  # the table went to stderr, keeping stdout pure JSON


def test_quantize_with_data_prints_accuracy_and_latency_and_writes_json(tmp_path):
    out, js = tmp_path / "mlp.onnx", tmp_path / "q.json"
    r = invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "-o", out, "--runs", "2", "--json", js)
    assert r.exit_code == 0, r.stderr
    assert "SQNR" in r.stdout and "speed-up" in r.stdout
    doc = json.loads(js.read_text())
    assert doc["comparison"]["accuracy"]["overall"]["sqnr_db"] > 30
    assert len(doc["quantized"]["nodes"]) == 3 and doc["output"]["bytes"] == out.stat().st_size


def test_missing_model_file(tmp_path):
    assert_user_error(
        invoke("quantize", tmp_path / "nope.onnx", "--data", calib_dir("cnn"), "-o", tmp_path / "o.onnx"),
        "model file not found",
        "nope.onnx",
    )


@pytest.mark.parametrize("content", [b"", b"this is not a protobuf at all \x00\xff" * 10, b"\x08\x01"])
def test_file_that_is_not_onnx(tmp_path, content):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    assert_user_error(invoke("calibrate", bad, calib_dir("cnn"), "-o", tmp_path / "s.json"), "bad.onnx")
    assert not (tmp_path / "s.json").exists()


def test_empty_data_directory(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(
        invoke("calibrate", sample("cnn"), empty, "-o", tmp_path / "s.json"), "holds no samples", str(empty)
    )


def test_sample_with_wrong_shape_names_file_input_and_shapes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.zeros((3, 28, 28), np.float32))
    r = invoke("calibrate", sample("cnn"), data, "-o", tmp_path / "s.json")
    assert_user_error(r, "a.npy", "input 'input'", "[batch, 3, 32, 32]", "[3, 28, 28]")


def test_sample_with_wrong_dtype(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.zeros((64,), np.float64))
    assert_user_error(
        invoke("calibrate", sample("mlp"), data, "-o", tmp_path / "s.json"), "a.npy", "float32", "float64"
    )


def test_unknown_observer(tmp_path):
    r = invoke("calibrate", sample("mlp"), calib_dir("mlp"), "-o", tmp_path / "s.json", "--observer", "magic")
    assert_user_error(r, "unknown observer 'magic'", "minmax")


def test_quantize_refuses_to_overwrite_its_input(tmp_path):
    model = tmp_path / "m.onnx"
    shutil.copy(sample("mlp"), model)
    before = model.read_bytes()
    assert_user_error(invoke("quantize", model, "--data", calib_dir("mlp"), "-o", model), "never overwrites")
    assert model.read_bytes() == before


def test_failed_quantize_leaves_no_output_file(tmp_path):
    stats = tmp_path / "mlp.json"
    assert invoke("calibrate", sample("mlp"), calib_dir("mlp"), "-o", stats).exit_code == 0
    out = tmp_path / "cnn.onnx"
    assert_user_error(invoke("quantize", sample("cnn"), "--stats", stats, "-o", out), "different model")
    assert list(tmp_path.iterdir()) == [stats]


def test_stats_and_data_are_mutually_exclusive_and_static_activations_need_one(tmp_path):
    stats = tmp_path / "mlp.json"
    assert invoke("calibrate", sample("mlp"), calib_dir("mlp"), "-o", stats).exit_code == 0
    both = invoke("quantize", sample("mlp"), "--stats", stats, "--data", calib_dir("mlp"), "-o", tmp_path / "o.onnx")
    assert_user_error(both, "not both")
    integer = tmp_path / "integer.yaml"
    integer.write_text("global: {placement: integer}\n")
    neither = invoke("quantize", sample("mlp"), "--config", integer, "-o", tmp_path / "o.onnx")
    assert_user_error(neither, "activations are quantized statically: give --data DATA_DIR or --stats STATS.json")
    assert not (tmp_path / "o.onnx").exists()


def test_bad_config_names_file_line_and_column(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("global:\n  weight: {dtype: int3}\n")
    assert_user_error(
        invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "-o", tmp_path / "o.onnx", "--config", cfg),
        f"{cfg}:2:19",
        "int3",
    )


def test_node_name_that_matches_nothing_lists_close_names(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("node_name:\n  fc1/matmull: null\n")
    assert_user_error(
        invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "-o", tmp_path / "o.onnx", "--config", cfg),
        "fc1/matmull",
        "fc1/matmul",
    )


def test_config_can_keep_a_node_in_float(tmp_path):
    cfg, out = tmp_path / "c.yaml", tmp_path / "o.onnx"
    cfg.write_text("node_name:\n  fc2/matmul: null\n")
    r = invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "-o", out, "--config", cfg, "--runs", "0")
    assert r.exit_code == 0, r.stderr
    assert "kept in float" in r.stdout and "fc2/matmul" in r.stdout
    model = onnx.load(str(out))
    producer = {o: n for n in model.graph.node for o in n.output}
    fc2 = next(n for n in model.graph.node if n.name == "fc2/matmul")
    assert "fc2.weight" in {i.name for i in model.graph.initializer}  # still float
    assert fc2.input[1] not in producer


def test_observers_command_lists_minmax():
    r = invoke("observers")
    assert r.exit_code == 0 and "minmax" in r.stdout


def test_console_script_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "qtool", "--version"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.startswith("qtool ")


def test_internal_errors_exit_70_with_a_report_request(tmp_path, monkeypatch):
    import qtool.pipeline.build

    def boom(*args, **kwargs):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(qtool.pipeline.build, "insert_qdq", boom)
    r = invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "-o", tmp_path / "o.onnx")
    assert r.exit_code == 70
    assert "ZeroDivisionError" in r.stderr and "please report" in r.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_help_documents_every_option():
    for command in ("calibrate", "quantize", "tune", "compare"):
        r = invoke(command, "--help")
        assert r.exit_code == 0
        for line in r.stdout.splitlines():
            if line.strip().startswith("--") and "--help" not in line:
                assert len(line.split()) > 2, f"{command}: undocumented option: {line}"


def test_interrupted_write_leaves_neither_output_nor_temp_file(tmp_path, monkeypatch):
    import qtool.graph.model_io

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(qtool.graph.model_io.os, "replace", interrupted)
    r = invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "-o", tmp_path / "o.onnx")
    assert r.exit_code == 130 and "no output was written" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback_of_user_errors(tmp_path):
    r = runner.invoke(app, ["--debug", "calibrate", str(tmp_path / "nope.onnx"), str(calib_dir("cnn")), "-o", "s.json"])
    assert r.exit_code == 2
    assert "Traceback" in r.stderr and "model file not found" in r.stderr


def test_calibrate_and_compare_from_images_with_a_preprocess_block(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    images.mkdir()
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(images / f"{i}.png")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preprocess: {resize: 36, center_crop: 32, mean: [0.45, 0.45, 0.45], std: [0.25, 0.25, 0.25]}\n")
    stats, out = tmp_path / "s.json", tmp_path / "q.onnx"
    r = invoke("calibrate", sample("cnn"), images, "-o", stats, "--config", cfg)
    assert r.exit_code == 0, r.stderr
    assert json.loads(stats.read_text())["samples"] == 6
    assert invoke("quantize", sample("cnn"), "--stats", stats, "-o", out, "--config", cfg).exit_code == 0
    r = invoke("compare", sample("cnn"), out, "--data", images, "--config", cfg, "--runs", "0", "--json", "-")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["data"]["samples"] == 6


def test_nan_sample_fails_naming_file_and_input_unless_skipped(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i, f in enumerate(sorted(calib_dir("mlp").glob("*.npy"))[:4]):
        shutil.copy(f, data / f"{i}.npy")
    bad = np.load(data / "2.npy")
    bad[3] = np.inf
    np.save(data / "2.npy", bad)
    assert_user_error(invoke("calibrate", sample("mlp"), data, "-o", tmp_path / "s.json"), "2.npy", "'input'", "NaN")
    r = invoke("calibrate", sample("mlp"), data, "-o", tmp_path / "s.json", "--skip-nonfinite")
    assert r.exit_code == 0 and "skipped 1 samples" in r.stdout
    stats = json.loads((tmp_path / "s.json").read_text())
    assert (stats["samples"], stats["skipped"]) == (3, 1)


def test_inspect_lists_nodes_rules_and_predicted_compression_as_json(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("op_type: {Gemm: null}\nnode_name: {block1/conv: {weight: {dtype: int4}}}\n")
    r = invoke("inspect", sample("cnn"), "--config", cfg, "--json", "-")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert nodes["block1/conv"]["rule"] == "node_name:block1/conv" and nodes["block1/conv"]["weight"].startswith("int4")
    assert nodes["block0/conv"]["rule"] == "global"
    assert doc["kept_float"] == [
        {"node": "head/gemm", "op_type": "Gemm", "reason": "kept in float by the config (op_type:Gemm)"}
    ]
    assert doc["passthrough_ops"]["Relu"] == 3
    assert doc["totals"]["predicted_compression_ratio"] > 3.5
    assert "kept in float" in r.stderr and "predicted" in r.stderr
