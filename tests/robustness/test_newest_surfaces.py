"""The promises on the newest surfaces (issue 45): fp8 across the config's levels, float16 edges, numbers at the
edges, names, configs by name, tune's targets, statistics read whole, notes true to the run.

Each class: a bad input is one clear line naming the file, line or tensor, exit 2 and nothing written; what
the model allows is done; exit 70 stays for bugs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, eval_dir, sample

runner = CliRunner()
CNN = sample("cnn")


def _refused(args: list[object], needle: str, outputs: tuple[Path, ...] = ()) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.output
    assert not any(path.exists() for path in outputs)
    return errors[0]


# ---------------------------------------------------------------- fp8 rules across the config's levels
@pytest.mark.parametrize(
    ("rule", "setting", "line"),
    [
        ("block1/conv", "weight: {granularity: per_block}", 5),
        ("head/gemm", "weight: {format: matmul_nbits}", 5),
    ],
)
def test_fp8_from_an_op_type_rule_meets_a_node_name_rule_at_its_yaml_line(
    tmp_path: Path, rule: str, setting: str, line: int
) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(
        "op_type:\n"
        "  Conv: {weight: {dtype: fp8_e4m3}, activation: {dtype: fp8_e4m3}}\n"
        "  Gemm: {weight: {dtype: fp8_e4m3}, activation: {dtype: fp8_e4m3}}\n"
        "node_name:\n"
        f'  "{rule}": {{{setting}}}\n'
    )
    out = tmp_path / "q.onnx"
    error = _refused(["quantize", CNN, "--config", config, "-o", out], f"rules.yaml:{line}:", (out,))
    op = "Conv" if "conv" in rule else "Gemm"
    assert f"rule op_type:{op}" in error and f"rule node_name:{rule}" in error and f"node '{rule}'" in error


def test_a_node_name_rule_with_its_own_dtype_is_not_an_fp8_conflict(tmp_path: Path) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(
        "op_type:\n  Conv: {weight: {dtype: fp8_e4m3}, activation: {dtype: fp8_e4m3}}\n"
        'node_name:\n  "block1/conv": {weight: {dtype: int8, granularity: per_block, block_size: 32}}\n'
    )
    r = runner.invoke(app, ["inspect", str(CNN), "--config", str(config)])
    assert r.exit_code == 0, r.output
    assert "fp8" in r.output and "per_block" in r.output


@pytest.mark.slow
def test_tune_with_the_installed_fp8_config_writes_a_config_that_reads_back(tmp_path: Path) -> None:
    out, chosen = tmp_path / "t.onnx", tmp_path / "t.yaml"
    args = ["tune", CNN, "--config", "fp8", "-o", out, "--config-out", chosen, "--data", calib_dir("cnn")]
    args += ["--eval", eval_dir("cnn"), "--target-sqnr", "20", "--time-budget", "30", "--no-cache"]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    again = tmp_path / "again.onnx"
    r = runner.invoke(
        app, ["quantize", str(CNN), "--config", str(chosen), "--data", str(calib_dir("cnn")), "-o", str(again)]
    )
    assert r.exit_code == 0, r.output
    assert again.read_bytes() == out.read_bytes()


# ---------------------------------------------------------------- float16 models
def _float16_with_sparse_bias(path: Path, data: Path) -> None:
    weight = (np.random.default_rng(0).standard_normal((16, 8)) * 0.3).astype(np.float16)
    values = numpy_helper.from_array(np.array([0.5, -1.0], np.float16), "values")
    bias = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1, 5], np.int64), "indices"), [8])
    nodes = [
        helper.make_node("Constant", [], ["bias"], sparse_value=bias, name="bias"),
        helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "bias"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "sparse_bias",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", 8])],
        [numpy_helper.from_array(weight, "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(data / f"{i}.npy", rng.standard_normal(16).astype(np.float16))


def test_a_float16_model_with_a_sparse_constant_is_quantized(tmp_path: Path) -> None:
    model, data, out = tmp_path / "m.onnx", tmp_path / "data", tmp_path / "q.onnx"
    _float16_with_sparse_bias(model, data)
    r = runner.invoke(app, ["quantize", str(model), "--data", str(data), "-o", str(out)])
    assert r.exit_code == 0, r.output
    x = np.load(data / "0.npy")[None]
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    assert got.dtype == np.float16 and np.abs(got.astype(np.float32) - want).max() < 0.05


def test_the_tensorrt_cache_of_a_float16_model_names_its_own_tensors(tmp_path: Path) -> None:
    model, data, cache = tmp_path / "m.onnx", tmp_path / "data", tmp_path / "trt.cache"
    _float16_with_sparse_bias(model, data)
    args = ["calibrate", str(model), str(data), "-o", str(tmp_path / "s.json"), "--tensorrt-cache", str(cache)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    names = {line.split(":")[0] for line in cache.read_text().splitlines()[1:]}
    graph = onnx.load(model).graph
    tensors = {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    assert names and names <= tensors and "x" in names


# ---------------------------------------------------------------- numbers at the edges
def _cnn_with_first_conv_weight(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> str:
    model = onnx.load(CNN)
    init = next(i for i in model.graph.initializer if len(i.dims) == 4)
    init.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(init).copy()), init.name))
    onnx.save(model, path)
    return init.name


def test_weights_near_float_range_quantize_and_score_in_the_default(tmp_path: Path) -> None:
    """Outputs of ~1e30 overflow float32 energies: the scoring sums them in float64, no exit 70."""
    model, out, report = tmp_path / "big.onnx", tmp_path / "q.onnx", tmp_path / "q.json"
    _cnn_with_first_conv_weight(model, lambda w: (w * 1e30).astype(np.float32))
    args = ["quantize", model, "--data", calib_dir("cnn"), "-o", out, "--json", report]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["comparison"]["accuracy"]["overall"]["sqnr_db"] > 30


@pytest.mark.parametrize("config", ["integer", "default"])
def test_a_nan_weight_is_named_before_calibration(tmp_path: Path, config: str) -> None:
    model, out = tmp_path / "nan.onnx", tmp_path / "q.onnx"

    def poison(w: np.ndarray) -> np.ndarray:
        w.flat[3] = np.nan
        return w

    name = _cnn_with_first_conv_weight(model, poison)
    args = ["quantize", model, "--config", config, "--data", calib_dir("cnn"), "-o", out]
    error = _refused(list(args), f"weight '{name}'", (out,))
    assert "NaN or Inf" in error and "calibrate" not in error
