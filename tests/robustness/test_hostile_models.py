"""Models from elsewhere: external data (and where it may live), already-quantized and damaged files."""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.options import SearchOptions
from tests.conftest import calib_dir, sample

runner = CliRunner()


def quantize_cli(model, out, *extra):
    return runner.invoke(app, ["quantize", str(model), "--data", str(calib_dir("cnn")), "-o", str(out), *extra])


def external_copy(folder, location="weights.bin"):
    """The sample CNN saved with every weight in one external file."""
    folder.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(sample("cnn")))
    path = folder / "model.onnx"
    onnx.save(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location, size_threshold=0
    )
    return path


def test_external_data_model_quantizes_like_the_embedded_one(tmp_path):
    path = external_copy(tmp_path / "ext")
    assert (tmp_path / "ext" / "weights.bin").stat().st_size > 300_000  # the weights really are outside
    before = {p.name: p.read_bytes() for p in (tmp_path / "ext").iterdir()}
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    # no timing in the placement choice: on a loaded machine two timings may pick different placements
    untimed = SearchOptions(latency_runs=0)
    qtool.quantize(path, a, data_dir=calib_dir("cnn"), evaluation=None, search=untimed)
    qtool.quantize(sample("cnn"), b, data_dir=calib_dir("cnn"), evaluation=None, search=untimed)
    assert a.read_bytes() == b.read_bytes()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ext").iterdir()} == before  # inputs untouched


def _point_weights_at(path, location):
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(path))


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_external_data_outside_the_model_directory_is_refused(tmp_path, kind):
    path = external_copy(tmp_path / "ext")
    secret = tmp_path / "secret.bin"
    shutil.copy(tmp_path / "ext" / "weights.bin", secret)
    if kind == "absolute":
        _point_weights_at(path, str(secret))
    elif kind == "dotdot":
        _point_weights_at(path, "../secret.bin")
    else:
        (tmp_path / "ext" / "weights.bin").unlink()
        os.symlink(secret, tmp_path / "ext" / "weights.bin")
    out = tmp_path / "q.onnx"
    r = quantize_cli(path, out)
    assert r.exit_code == 2, r.output
    assert "outside the model's directory" in r.stderr and "refused" in r.stderr
    assert "Traceback" not in r.output and not out.exists()


def test_external_data_that_is_missing_or_too_short_is_a_clear_error(tmp_path):
    path = external_copy(tmp_path / "ext")
    data = tmp_path / "ext" / "weights.bin"
    data.write_bytes(data.read_bytes()[:1000])
    r = quantize_cli(path, tmp_path / "q.onnx")
    assert r.exit_code == 2 and "beyond the file's 1000 bytes" in r.stderr
    data.unlink()
    r = quantize_cli(path, tmp_path / "q.onnx")
    assert r.exit_code == 2 and "does not exist" in r.stderr and not (tmp_path / "q.onnx").exists()


def test_an_already_quantized_model_is_refused(tmp_path):
    once = tmp_path / "once.onnx"
    qtool.quantize(sample("cnn"), once, data_dir=calib_dir("cnn"), search=None, evaluation=None)  # Q/DQ nodes
    for command in (
        ["quantize", str(once), "--data", str(calib_dir("cnn")), "-o", str(tmp_path / "twice.onnx")],
        ["calibrate", str(once), str(calib_dir("cnn")), "-o", str(tmp_path / "s.json")],
        ["inspect", str(once)],
    ):
        r = runner.invoke(app, command)
        assert r.exit_code == 2, (command, r.output)
        assert "already quantized" in r.stderr and "is QuantizeLinear" in r.stderr
    assert not (tmp_path / "twice.onnx").exists() and not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "random"])
def test_damaged_model_files_are_clear_errors(tmp_path, damage):
    data = sample("cnn").read_bytes()
    bad = tmp_path / "bad.onnx"
    if damage == "empty":
        bad.write_bytes(b"")
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 3])
    else:
        bad.write_bytes(np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    out = tmp_path / "q.onnx"
    r = quantize_cli(bad, out)
    assert r.exit_code == 2, r.output
    assert str(bad) in r.stderr and "Traceback" not in r.output and not out.exists()
    assert len(r.stderr.strip().splitlines()) <= 3  # one line, and at most a hint


def _identity_model(path, *, ir_version, opset=17):
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=ir_version)
    path.write_bytes(model.SerializeToString())
    return path


def test_an_ir_version_newer_than_onnx_reads_is_a_clear_error(tmp_path):
    path = _identity_model(tmp_path / "new.onnx", ir_version=onnx.IR_VERSION + 1)
    r = runner.invoke(app, ["quantize", str(path), "--data", str(tmp_path), "-o", str(tmp_path / "q.onnx")])
    assert r.exit_code == 2, r.output
    assert f"IR version {onnx.IR_VERSION + 1}" in r.stderr and f"IR version {onnx.IR_VERSION} at most" in r.stderr
    assert str(path) in r.stderr and "Traceback" not in r.output


def test_an_ir_version_newer_than_onnxruntime_loads_names_both_versions(tmp_path):
    import onnxruntime as ort

    path = _identity_model(tmp_path / "new.onnx", ir_version=onnx.IR_VERSION)
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        pytest.skip(f"onnxruntime {ort.__version__} loads IR version {onnx.IR_VERSION}, the newest onnx writes")
    except Exception:  # noqa: BLE001 - the refusal this test is about
        pass
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "0.npy", np.ones((1, 4), np.float32))
    for command in (
        ["quantize", str(path), "--data", str(tmp_path / "data"), "-o", str(tmp_path / "q.onnx")],
        ["calibrate", str(path), str(tmp_path / "data"), "-o", str(tmp_path / "s.json")],
    ):
        r = runner.invoke(app, command)
        assert r.exit_code == 2, r.output
        assert f"{path} has ONNX IR version {onnx.IR_VERSION}, newer than onnxruntime" in r.stderr, r.stderr
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "s.json").exists()


def test_a_model_onnxruntime_cannot_load_is_named_not_blamed_on_the_result(tmp_path):
    # nothing here runs the float model before the result is loaded (weights only, no data): when onnxruntime
    # refuses the result, the input is tried, and its own refusal names the file
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node("StringNormalizer", ["s"], ["t"], case_change_action="LOWER", locale="xx_NOT_A_LOCALE"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]), helper.make_tensor_value_info("s", 8, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64]), helper.make_tensor_value_info("t", 8, [2])],
        [weight],
    )
    model, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    r = runner.invoke(app, ["quantize", str(model), "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert f"onnxruntime cannot load {model}:" in r.stderr and "the quantized model" not in r.stderr
    assert "xx_NOT_A_LOCALE" in r.stderr and not out.exists()
