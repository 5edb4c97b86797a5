"""weight.saturation: integer kernels stay exact on x86 CPUs whose uint8 x int8 sums saturate in int16."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.numerics.saturation import COLUMNS, overflowing_columns
from qtool.system.environment import cpu_info, int8_kernels_saturate

runner = CliRunner()


def _saturating_model(tmp_path: Path, weight: np.ndarray | None = None) -> tuple[Path, Path, list[np.ndarray]]:
    """A MatMul whose every weight is the channel's extreme, fed activations quantized near 255 and 0.

    With full-range int8 weights a pair of products reaches 255 x 127 x 2 = 64770, twice what
    VPMADDUBSW's int16 sum holds.
    """
    rng = np.random.default_rng(7)
    if weight is None:
        weight = np.where(rng.random((64, 8)) < 0.5, -1.0, 1.0).astype(np.float32)
        weight[:, 0] = 1.0  # one column of equal signs: every pair adds up
    # an identity MatMul reads y, so y is quantized (a last layer's output stays float: see plan/outputs.py) and
    # the integer kernel under test writes 8-bit values; the identity's int8 weight is exact
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
            helper.make_node("MatMul", ["y", "eye"], ["z"], name="identity"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.eye(8, dtype=np.float32), "eye")],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "data"
    data.mkdir()
    samples = [np.sign(rng.normal(size=(64,))).astype(np.float32) for _ in range(8)]  # at the range's ends
    for i, sample in enumerate(samples):
        np.save(data / f"{i}.npy", sample)
    return model, data, samples


def _run(path: Path, x: np.ndarray, level: ort.GraphOptimizationLevel) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x[None]})[0]


def _quantize(tmp_path: Path, model: Path, data: Path, guard: str) -> Path:
    config = tmp_path / f"{guard}.yaml"
    config.write_text(f"global: {{placement: integer, weight: {{saturation: {guard}}}}}\n")
    out = tmp_path / f"{guard}.onnx"
    qtool.quantize(model, out, data_dir=data, config_path=config, search=None, evaluation=None)
    return out


_AVX2_RUNNER = """
import sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
np.save(sys.argv[3], session.run(None, {"x": np.load(sys.argv[2])[None]})[0])
"""


def _run_on_avx2(path: Path, x: np.ndarray) -> np.ndarray | None:
    """The model's output from onnxruntime's AVX2 kernels: this interpreter under ``qemu-x86_64 -cpu Haswell``
    (AVX2, no VNNI), or None without qemu."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    version = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout.split()
    numbers = next((v for v in version if v[:1].isdigit()), "0").split(".")
    if tuple(int(n) for n in numbers[:2] if n.isdigit()) < (7, 2):  # AVX2 emulation came with qemu 7.2
        return None
    np.save(path.with_suffix(".x.npy"), x)
    done = subprocess.run(
        [
            qemu,
            "-cpu",
            "Haswell",
            sys.executable,
            "-c",
            _AVX2_RUNNER,
            str(path),
            str(path.with_suffix(".x.npy")),
            str(path.with_suffix(".y.npy")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(path.with_suffix(".y.npy"))


def _quantize_json(tmp_path: Path, model: Path, data: Path) -> str:
    config = tmp_path / "integer.yaml"
    config.write_text("global: {placement: integer}\n")
    args = ["quantize", str(model), "--data", str(data), "--config", str(config), "-o", str(tmp_path / "j.onnx")]
    result = runner.invoke(app, [*args, "--json", "-", "--no-search"])
    assert result.exit_code == 0, result.output
    return result.stdout


def _kernel_error(out: Path, samples: list[np.ndarray]) -> float:
    """Largest difference between onnxruntime's fused integer kernel and the same Q/DQ graph run in float."""
    return max(
        float(
            np.abs(
                _run(out, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
                - _run(out, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
            ).max()
        )
        for x in samples
    )


def _stored_weight(out: Path) -> tuple[np.ndarray, np.ndarray]:
    model = onnx.load(str(out))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "w")
    return inits[dq.input[0]], inits[dq.input[2]]


@pytest.mark.parametrize("guard", ["uint8", "reduce_range"])
def test_guarded_weights_give_exact_integer_kernels_on_this_cpu(tmp_path, guard):
    model, data, samples = _saturating_model(tmp_path)
    out = _quantize(tmp_path, model, data, guard)
    stored, zero = _stored_weight(out)
    if guard == "uint8":
        assert stored.dtype == np.uint8 and np.all(zero == 128)
        assert np.abs(stored.astype(np.int16) - 128).max() == 127  # all 255 levels kept
    else:
        assert stored.dtype == np.int8 and np.all(zero == 0)
        assert np.abs(stored).max() == 63  # [-64, 63], narrow: [-63, 63]
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "y/scale")))
    assert _kernel_error(out, samples) <= 1.01 * scale  # at most one output step of rounding
    avx2 = _run_on_avx2(out, samples[0])  # and on onnxruntime's AVX2 kernels, where int8 pairs saturate
    if avx2 is not None:
        assert np.abs(avx2 - _run(out, samples[0], ort.GraphOptimizationLevel.ORT_DISABLE_ALL)).max() <= 1.01 * scale


def test_full_range_int8_weights_saturate_without_vnni(tmp_path):
    model, data, samples = _saturating_model(tmp_path)
    out = _quantize(tmp_path, model, data, "ignore")
    stored, _ = _stored_weight(out)
    assert stored.dtype == np.int8 and np.abs(stored).max() == 127
    cpu = cpu_info()
    if not int8_kernels_saturate(cpu["flags"], cpu["machine"]):
        pytest.skip("this CPU multiplies uint8 x int8 without saturating (VNNI or not x86)")
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "y/scale")))
    assert _kernel_error(out, samples) > 10 * scale  # the hazard the guard exists for


def test_int8_activations_get_fitted_int8_weights_by_default(tmp_path):
    model, data, samples = _saturating_model(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("global: {placement: integer, activation: {dtype: int8, symmetric: true}}\n")
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, config_path=config, search=None, evaluation=None)
    stored, _ = _stored_weight(out)
    assert stored.dtype == np.int8 and np.abs(stored).max() == 64  # equal weights: pairs of 64 + 64 = 128
    assert overflowing_columns(stored, COLUMNS) == 0
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "y/scale")))
    assert _kernel_error(out, samples) <= 1.01 * scale


def test_auto_fits_the_pairs_that_can_saturate_and_keeps_int8_storage(tmp_path):
    model, data, samples = _saturating_model(tmp_path)
    out = _quantize(tmp_path, model, data, "auto")
    stored, zero = _stored_weight(out)
    assert stored.dtype == np.int8 and np.all(zero == 0)
    assert overflowing_columns(stored, COLUMNS) == 0 and np.abs(stored).max() == 64
    report = json.loads(_quantize_json(tmp_path, model, data))
    config = tmp_path / "integer.yaml"
    rows = {r.name: r for r in qtool.inspect(model, config_path=config, data_dir=data).rows}
    assert rows["mm"].weight_form.startswith("int8 fitted: 8/8 channels")  # inspect shows the same form
    assert rows["identity"].weight_form == "int8"  # the identity's pairs cannot saturate: full range
    assert report["weight_forms"]["counts"] == {"int8 fitted": 1, "int8": 1}
    assert report["weight_forms"]["fitted_bits"]["mm"] > 0.9
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "y/scale")))
    assert _kernel_error(out, samples) <= 1.01 * scale
    for x in samples:  # the same model run by onnxruntime's AVX2 kernels (emulated), where pairs saturate
        avx2 = _run_on_avx2(out, x)
        if avx2 is None:
            pytest.skip("qemu-x86_64 is not installed: the AVX2 kernels cannot be run on this CPU")
        assert np.abs(avx2 - _run(out, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)).max() <= 1.01 * scale


def test_auto_keeps_full_range_int8_where_no_pair_can_saturate(tmp_path):
    rng = np.random.default_rng(3)
    weight = rng.normal(scale=0.002, size=(64, 8)).astype(np.float32)
    weight[rng.integers(0, 64, 8), np.arange(8)] = 1.0  # one large weight per column, the rest below a step
    model, data, _ = _saturating_model(tmp_path, weight)
    out = _quantize(tmp_path, model, data, "auto")
    stored, _ = _stored_weight(out)
    assert stored.dtype == np.int8 and np.abs(stored).max() == 127  # the full grid
    assert overflowing_columns(stored, COLUMNS) == 0


def test_a_vnni_deployment_keeps_full_range_weights(tmp_path):
    model, data, _ = _saturating_model(tmp_path)
    out = tmp_path / "vnni.onnx"
    config = tmp_path / "integer.yaml"
    config.write_text("global: {placement: integer}\n")
    result = qtool.quantize(model, out, data_dir=data, config_path=config, target="cpu_vnni", search=None)
    stored, _ = _stored_weight(out)
    assert stored.dtype == np.int8 and np.abs(stored).max() == 127 and overflowing_columns(stored, COLUMNS) > 0
    assert result.rewrite.weight_forms == {"mm": "int8 unguarded", "identity": "int8 unguarded"}


def test_full_range_int8_weights_saturate_in_the_avx2_kernels(tmp_path):
    """The hazard, shown on onnxruntime's own AVX2 kernels (emulated, so on any x86 CPU)."""
    model, data, samples = _saturating_model(tmp_path)
    out = _quantize(tmp_path, model, data, "ignore")
    x = samples[0]
    avx2 = _run_on_avx2(out, x)
    if avx2 is None:
        pytest.skip("qemu-x86_64 is not installed: the AVX2 kernels cannot be run on this CPU")
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "y/scale")))
    assert np.abs(avx2 - _run(out, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)).max() > 10 * scale


def test_an_unknown_guard_is_a_config_error_naming_the_line(tmp_path):
    model, data, _ = _saturating_model(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("global:\n  weight:\n    saturation: clamp\n")
    out = tmp_path / "q.onnx"
    result = runner.invoke(app, ["quantize", str(model), "--data", str(data), "--config", str(config), "-o", str(out)])
    assert result.exit_code == 2
    assert "c.yaml:3" in result.output and "saturation" in result.output and "reduce_range" in result.output
    assert not out.exists()
