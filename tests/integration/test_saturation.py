"""weight.saturation: integer kernels stay exact on x86 CPUs whose uint8 x int8 sums saturate in int16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.system.environment import cpu_info, int8_kernels_saturate

runner = CliRunner()


def _saturating_model(tmp_path: Path) -> tuple[Path, Path, list[np.ndarray]]:
    """A MatMul whose every weight is the channel's extreme, fed activations quantized near 255 and 0.

    With full-range int8 weights a pair of products reaches 255 x 127 x 2 = 64770, twice what
    VPMADDUBSW's int16 sum holds.
    """
    rng = np.random.default_rng(7)
    weight = np.where(rng.random((64, 8)) < 0.5, -1.0, 1.0).astype(np.float32)
    weight[:, 0] = 1.0  # one column of equal signs: every pair adds up
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(weight, "w")],
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


def test_int8_activations_get_the_reduced_range_under_the_uint8_guard(tmp_path):
    model, data, samples = _saturating_model(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("global: {placement: integer, activation: {dtype: int8, symmetric: true}}\n")
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, config_path=config, search=None, evaluation=None)
    stored, _ = _stored_weight(out)
    assert stored.dtype == np.int8 and np.abs(stored).max() == 63  # no uint8 x int8 kernel: reduced int8
    scale = float(numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "y/scale")))
    assert _kernel_error(out, samples) <= 1.01 * scale


def test_an_unknown_guard_is_a_config_error_naming_the_line(tmp_path):
    model, data, _ = _saturating_model(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text("global:\n  weight:\n    saturation: clamp\n")
    out = tmp_path / "q.onnx"
    result = runner.invoke(app, ["quantize", str(model), "--data", str(data), "--config", str(config), "-o", str(out)])
    assert result.exit_code == 2
    assert "c.yaml:3" in result.output and "saturation" in result.output and "reduce_range" in result.output
    assert not out.exists()
