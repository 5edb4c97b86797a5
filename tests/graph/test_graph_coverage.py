"""Graphs qtool must handle (issue 7), each a tiny onnx.helper model: quantized, checked, run and compared with fp32.

Every test checks four things: onnx's full checker accepts the output, onnxruntime runs it, its outputs
stay close to the float model's (SQNR on the calibration samples; a lost bias or a misread input costs
tens of dB), and the nodes meant to be quantized really read Q/DQ activations and int8 weights.
Per-channel weights are also restored by onnx's ReferenceEvaluator and compared channel by channel.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from rich.console import Console
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import QtoolError
from qtool.graph.opsets import qdq_kernel_opset
from qtool.reports.documents import quantize_to_dict
from qtool.reports.tables import render_quantize
from tests.conftest import INTEGER, run_model

SEED = 11
RNG = np.random.default_rng(SEED)
FLOAT = TensorProto.FLOAT


@pytest.fixture(autouse=True)
def _reseed() -> None:
    """The same weights and samples for a test however many others run before it."""
    RNG.bit_generator.state = np.random.default_rng(SEED).bit_generator.state


def _newest_common_opset() -> int:
    """The newest default-domain opset that both onnx defines and the installed onnxruntime loads."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [_value("x", FLOAT, [1])], [_value("y", FLOAT, [1])]
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4
    for opset in range(onnx.defs.onnx_opset_version(), 13, -1):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=_ir_for(opset))
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - onnxruntime refuses opsets it does not know with a generic error
            continue
        return opset
    raise RuntimeError("onnxruntime loads no opset above 13")


def _ir_for(opset: int) -> int:
    return max(8, helper.find_min_ir_version_for([helper.make_opsetid("", opset)]))


def _value(name: str, elem_type: int, shape: list[int | str] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def _weight(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.normal(size=shape) * scale).astype(np.float32), name)


def _save(
    tmp_path: Path,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: list[onnx.TensorProto] | None = None,
    opset: int = 13,
) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=_ir_for(opset))
    onnx.checker.check_model(model, full_check=True)  # the test model itself must be valid
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    return path


Sampler = Callable[[int], dict[str, np.ndarray]]  # sample index -> feed, batch dimension included


def _data(tmp_path: Path, sampler: Sampler, n: int = 8) -> tuple[Path, list[dict[str, np.ndarray]]]:
    """A calibration directory of ``n`` .npz samples, and the same feeds for the comparison.

    Comparing on the calibration samples keeps range clipping out of the SQNR, which is then
    a measure of the rewrite alone.
    """
    directory = tmp_path / "calib"
    directory.mkdir()
    feeds = [sampler(i) for i in range(n)]
    for i, feed in enumerate(feeds):
        arrays: dict[str, Any] = feed
        np.savez(directory / f"{i:03d}.npz", **arrays)
    return directory, feeds


def _normal(*shape: int) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


def _quantize(model: Path, data: Path) -> tuple[qtool.QuantizeResult, onnx.ModelProto, Path]:
    """Quantize with every node as an integer kernel (configs/integer.yaml): Q/DQ around all of them."""
    out = model.with_name("quantized.onnx")
    result = qtool.quantize(model, out, data_dir=data, config_path=INTEGER, search=None, evaluation=None)
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    return result, quantized, out


def _sqnr(model: Path, quantized: Path, feeds: list[dict[str, np.ndarray]]) -> float:
    """The worst SQNR (dB) over the float outputs, each summed over ``feeds``; other outputs must match in type."""
    signal: dict[int, float] = {}
    noise: dict[int, float] = {}
    for feed in feeds:
        reference, candidate = run_model(model, feed), run_model(quantized, feed)
        for k, (r, c) in enumerate(zip(reference, candidate, strict=True)):
            assert r.dtype == c.dtype, k
            if r.dtype != np.float32:
                continue
            assert r.shape == c.shape, k
            signal[k] = signal.get(k, 0.0) + float(np.sum(r.astype(np.float64) ** 2))
            noise[k] = noise.get(k, 0.0) + float(np.sum((r.astype(np.float64) - c) ** 2))
    return min(10 * np.log10(signal[k] / max(noise[k], 1e-30)) for k in signal)


def _channel_errors(quantized: onnx.ModelProto, tensor: str, original: np.ndarray, axis: int) -> np.ndarray:
    """Relative error of each channel (along ``axis``) of a weight as the quantized model restores it.

    onnx's ReferenceEvaluator runs the model's own DequantizeLinear: an independent oracle. A weight
    quantized along the wrong axis loses its small channels here, even where the large ones still
    dominate every output's SQNR.
    """
    dq = next(n for n in quantized.graph.node if tensor in n.output)
    inits = [i for i in quantized.graph.initializer if i.name in dq.input]
    graph = helper.make_graph([dq], "dq", [], [_value(tensor, FLOAT, None)], inits)
    # the evaluator implements DequantizeLinear from opset 19; per-axis numerics are the same as 13's
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (restored,) = ReferenceEvaluator(model).run(None, {})
    moved, reference = np.moveaxis(np.asarray(restored), axis, 0), np.moveaxis(original, axis, 0)
    flat = (moved - reference).reshape(len(moved), -1), reference.reshape(len(reference), -1)
    return np.linalg.norm(flat[0], axis=1) / np.linalg.norm(flat[1], axis=1)


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _source(model: onnx.ModelProto, tensor: str) -> str:
    """What a tensor is made of: "activation" (Q -> DQ), "int8 weight" (DQ of an int8 constant) or "float"."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    dq = producers.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return "float"
    source = dq.input[0]
    if source in producers and producers[source].op_type == "QuantizeLinear":
        return "activation"
    if source in inits and inits[source].data_type in (TensorProto.INT8, TensorProto.UINT8):
        return "int8 weight"
    return "float"


def _weight_axis(model: onnx.ModelProto, tensor: str) -> int | None:
    """The axis of the DequantizeLinear that writes a weight (None: per tensor)."""
    dq = next(n for n in model.graph.node if tensor in n.output)
    inits = {i.name: i for i in model.graph.initializer}
    scale = inits[dq.input[1]]
    if list(scale.dims) in ([], [1]):
        return None
    return next((a.i for a in dq.attribute if a.name == "axis"), 1)


def _assert_per_channel(quantized: onnx.ModelProto, name: str, original: np.ndarray, axis: int) -> None:
    """The node's weight (input 1) is stored per channel along ``axis``, and every channel survives."""
    weight = _node(quantized, name).input[1]
    assert _weight_axis(quantized, weight) == axis
    assert _channel_errors(quantized, weight, original, axis).max() < 0.02


def _assert_integer(model: onnx.ModelProto, name: str, activations: tuple[int, ...], weight: int | None) -> None:
    node = _node(model, name)
    for k in activations:
        assert _source(model, node.input[k]) == "activation", (name, k, node.input[k])
    if weight is not None:
        assert _source(model, node.input[weight]) == "int8 weight", (name, weight, node.input[weight])


# -- shapes and inputs ----------------------------------------------------------------------------


def test_dynamic_batch_and_spatial_dims_calibrated_at_one_size_run_at_another(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Transpose", ["y"], ["t"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["t", "w3"], ["z"], name="mm"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, ["N", 3, "H", "W"])],
        [_value("y", FLOAT, ["N", 8, "H2", "W2"]), _value("z", FLOAT, ["N", "H2", "W2", 5])],
        [_weight("w1", 6, 3, 3, 3), _weight("b1", 6), _weight("w2", 8, 6, 3, 3), _weight("w3", 8, 5)],
    )
    data, _ = _data(tmp_path, lambda i: {"x": _normal(1, 3, 8, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["conv1", "conv2", "mm"]
    for name in ("conv1", "conv2", "mm"):
        _assert_integer(quantized, name, (0,), 1)
    feeds = [{"x": _normal(3, 3, 16, 12)}, {"x": _normal(2, 3, 5, 7)}]  # other batch and spatial sizes
    assert _sqnr(model, out, feeds) > 25


def test_several_inputs_and_outputs_with_int64_and_bool_inputs_beside_float_ones(tmp_path):
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),  # [N, 4, 8]
        helper.make_node("MatMul", ["emb", "w_emb"], ["e"], name="mm_emb"),  # [N, 4, 6]
        helper.make_node("MatMul", ["x", "w_x"], ["h"], name="mm_x"),  # [N, 6]
        helper.make_node("Where", ["mask", "h", "zero"], ["masked"], name="where"),
        helper.make_node("Gemm", ["masked", "w_out", "b_out"], ["y"], name="head"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [
            _value("x", FLOAT, ["N", 8]),
            _value("ids", TensorProto.INT64, ["N", 4]),
            _value("mask", TensorProto.BOOL, ["N", 6]),
        ],
        [_value("e", FLOAT, ["N", 4, 6]), _value("y", FLOAT, ["N", 3]), _value("masked", FLOAT, ["N", 6])],
        [
            _weight("table", 600, 8, scale=1.0),  # 4,800 values: a table large enough to be stored quantized
            _weight("w_emb", 8, 6),
            _weight("w_x", 8, 6),
            numpy_helper.from_array(np.zeros((), np.float32), "zero"),
            _weight("w_out", 6, 3),
            _weight("b_out", 3),
        ],
    )

    def sample(i: int) -> dict[str, np.ndarray]:
        return {
            "x": _normal(2, 8),
            "ids": RNG.integers(0, 10, size=(2, 4)).astype(np.int64),
            "mask": RNG.random((2, 6)) > 0.3,
        }

    data, feeds = _data(tmp_path, sample)
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["embed", "mm_emb", "mm_x", "head"]
    assert "table" in result.rewrite.quantized_weights  # the embedding table, stored int8 and restored at load
    for name in ("mm_emb", "mm_x", "head"):
        _assert_integer(quantized, name, (0,), 1)
    assert not {"ids", "mask"} & set(result.rewrite.quantized_activations)
    assert _sqnr(model, out, feeds) > 25


def test_constant_node_weights_and_weights_shared_by_two_nodes(tmp_path):
    nodes = [
        helper.make_node(
            "Constant", [], ["w_conv"], name="const_w", value=numpy_helper.from_array(_normal(4, 3, 3, 3))
        ),
        helper.make_node("Constant", [], ["b_conv"], name="const_b", value_floats=[0.1, -0.2, 0.3, 0.0]),
        helper.make_node(
            "Constant", [], ["w_const"], name="const_mm", value=numpy_helper.from_array(_normal(8, 8) * 0.3)
        ),
        helper.make_node("Conv", ["x", "w_conv", "b_conv"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        # an initializer read by two MatMuls, and a Constant read by two more
        helper.make_node("MatMul", ["c", "w_init"], ["m1"], name="mm1"),
        helper.make_node("MatMul", ["m1", "w_init"], ["m2"], name="mm2"),
        helper.make_node("MatMul", ["m2", "w_const"], ["y1"], name="mm3"),
        helper.make_node("MatMul", ["c", "w_const"], ["y2"], name="mm4"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, [1, 3, 8, 8])],
        [_value("y1", FLOAT, [1, 4, 8, 8]), _value("y2", FLOAT, [1, 4, 8, 8])],
        [_weight("w_init", 8, 8)],
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(1, 3, 8, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.prepare.constants_to_initializers == 3
    assert result.rewrite.quantized_nodes == ["conv", "mm1", "mm2", "mm3", "mm4"]
    for name in result.rewrite.quantized_nodes:
        _assert_integer(quantized, name, (0,), 1)
    assert result.rewrite.quantized_biases == ["b_conv"]
    # a shared weight is stored once, as int8, and both readers read the same dequantized tensor
    assert _node(quantized, "mm1").input[1] == _node(quantized, "mm2").input[1]
    assert _node(quantized, "mm3").input[1] == _node(quantized, "mm4").input[1]
    assert sorted(result.rewrite.quantized_weights) == ["w_const", "w_conv", "w_init"]
    assert not {"w_init", "w_conv", "w_const"} & {i.name for i in quantized.graph.initializer}
    assert "Constant" not in {n.op_type for n in quantized.graph.node}
    assert _sqnr(model, out, feeds) > 25


def test_a_weight_fed_as_a_graph_input_is_left_float_and_reported(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["a"], name="mm_input_weight"),
        helper.make_node("Gemm", ["x", "g_in"], ["b"], name="gemm_input_weight", transB=1),
        helper.make_node("MatMul", ["x", "w"], ["c"], name="mm_constant"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, ["N", 8]), _value("w_in", FLOAT, [8, 4]), _value("g_in", FLOAT, [4, 8])],
        [_value("a", FLOAT, ["N", 4]), _value("b", FLOAT, ["N", 4]), _value("c", FLOAT, ["N", 4])],
        [_weight("w", 8, 4)],
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(2, 8), "w_in": _normal(8, 4), "g_in": _normal(4, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["mm_constant"]
    skipped = dict(result.skipped)
    assert "w_in" in skipped["mm_input_weight"] and "graph input" in skipped["mm_input_weight"]
    assert "g_in" in skipped["gemm_input_weight"] and "graph input" in skipped["gemm_input_weight"]
    assert _node(quantized, "mm_input_weight").input[:] == ["x", "w_in"]  # untouched, float
    assert _node(quantized, "gemm_input_weight").input[:] == ["x", "g_in"]
    assert _sqnr(model, out, feeds) > 25

    # ... and the CLI says so, in its summary and in its JSON document
    cli_out = tmp_path / "cli.onnx"
    report = tmp_path / "report.json"
    run = CliRunner().invoke(
        app,
        [
            "quantize",
            str(model),
            "--data",
            str(data),
            "-o",
            str(cli_out),
            "--config",
            str(INTEGER),
            "--runs",
            "0",
            "--json",
            str(report),
        ],
    )
    assert run.exit_code == 0, run.stderr
    assert "mm_input_weight" in run.stdout and "graph input" in run.stdout
    document = json.loads(report.read_text())
    reasons = {entry["node"]: entry["reason"] for entry in document["skipped"]}
    assert "graph input" in reasons["mm_input_weight"] and "graph input" in reasons["gemm_input_weight"]


# -- Conv, ConvTranspose, Gemm, MatMul variants -----------------------------------------------------


@pytest.mark.parametrize(
    ("weight_shape", "group", "bias"),
    [((8, 4, 3, 3), 1, True), ((8, 4, 3, 3), 1, False), ((8, 2, 3, 3), 2, True), ((4, 1, 3, 3), 4, True)],
    ids=["with_bias", "without_bias", "grouped", "depthwise"],
)
def test_conv_variants(tmp_path, weight_shape, group, bias):
    out_channels = weight_shape[0]
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    nodes = [helper.make_node("Conv", inputs, ["y"], name="conv", group=group, pads=[1, 1, 1, 1])]
    # per-output-channel scales over three decades: per tensor, the small channels would be lost
    scales = np.logspace(-2, 1, out_channels).astype(np.float32)[:, None, None, None]
    w = (_normal(*weight_shape) * scales).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), *([_weight("b", out_channels)] if bias else [])]
    model = _save(
        tmp_path, nodes, [_value("x", FLOAT, ["N", 4, 8, 8])], [_value("y", FLOAT, ["N", out_channels, 8, 8])], inits
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(1, 4, 8, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["conv"]
    _assert_integer(quantized, "conv", (0,), 1)
    _assert_per_channel(quantized, "conv", w, axis=0)
    assert result.rewrite.quantized_biases == (["b"] if bias else [])
    assert _sqnr(model, out, feeds) > 30


@pytest.mark.parametrize(
    ("group", "bias"), [(1, True), (1, False), (2, True)], ids=["with_bias", "without_bias", "grouped_with_bias"]
)
def test_conv_transpose_weights_are_per_channel_along_axis_1(tmp_path, group, bias):
    # ConvTranspose weights are [C_in, C_out / group, kH, kW]: output channels lie along axis 1
    per_group = 6 // group
    scales = np.logspace(-2, 1, per_group).astype(np.float32)[None, :, None, None]  # a wrong axis loses the small
    w = (_normal(4, per_group, 3, 3) * scales).astype(np.float32)
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    nodes = [helper.make_node("ConvTranspose", inputs, ["y"], name="deconv", strides=[2, 2], group=group)]
    inits = [numpy_helper.from_array(w, "w"), *([_weight("b", 6)] if bias else [])]
    model = _save(tmp_path, nodes, [_value("x", FLOAT, ["N", 4, 5, 5])], [_value("y", FLOAT, ["N", 6, 11, 11])], inits)
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(1, 4, 5, 5)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["deconv"]
    _assert_integer(quantized, "deconv", (0,), 1)
    _assert_per_channel(quantized, "deconv", w, axis=1)
    # with groups, axis 1 holds C_out / group scales, not one per output channel: the bias stays float
    assert result.rewrite.quantized_biases == (["b"] if bias and group == 1 else [])
    assert _sqnr(model, out, feeds) > 30


@pytest.mark.parametrize(
    ("trans_a", "trans_b", "alpha", "beta"),
    [(0, 0, 1.0, 1.0), (1, 0, 1.0, 1.0), (0, 1, 1.0, 1.0), (1, 1, 0.5, 2.0), (0, 1, 1.5, 0.25)],
    ids=["plain", "transA", "transB", "both_scaled", "transB_scaled"],
)
def test_gemm_variants(tmp_path, trans_a, trans_b, alpha, beta):
    k, n = 12, 6
    scales = np.logspace(-2, 1, n).astype(np.float32)  # per output column: a wrong axis would lose the small ones
    w = _normal(k, n) * scales[None, :]
    if trans_b:
        w = np.ascontiguousarray(w.T)
    b = numpy_helper.from_array(w, "b")
    a_shape: list[int | str] = [k, "N"] if trans_a else ["N", k]
    nodes = [
        helper.make_node(
            "Gemm", ["a", "b", "c"], ["y"], name="gemm", transA=trans_a, transB=trans_b, alpha=alpha, beta=beta
        )
    ]
    model = _save(
        tmp_path, nodes, [_value("a", FLOAT, a_shape)], [_value("y", FLOAT, ["N", n])], [b, _weight("c", n, scale=1.0)]
    )
    data, feeds = _data(tmp_path, lambda i: {"a": _normal(k, 3) if trans_a else _normal(3, k)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["gemm"]
    _assert_integer(quantized, "gemm", (0,), 1)
    _assert_per_channel(quantized, "gemm", w, axis=0 if trans_b else 1)
    # an int32 bias is only right when it is added unscaled: alpha * A @ B + beta * C with alpha = beta = 1
    assert result.rewrite.quantized_biases == (["c"] if alpha == beta == 1 else [])
    assert _sqnr(model, out, feeds) > 30


def test_matmul_with_the_constant_on_either_side_and_batched(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w_right"], ["right"], name="mm_right"),  # [N, T, 8] x [8, 6]
        helper.make_node("MatMul", ["w_left", "x"], ["left"], name="mm_left"),  # [5, T] x [N, T, 8]
        helper.make_node("Transpose", ["x"], ["xt"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "xt"], ["gram"], name="mm_batched"),  # [N, T, 8] x [N, 8, T]
        helper.make_node("MatMul", ["x", "w_3d"], ["stacked"], name="mm_3d_weight"),  # [N, T, 8] x [N, 8, 4]
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, [2, 7, 8])],
        [
            _value("right", FLOAT, [2, 7, 6]),
            _value("left", FLOAT, [2, 5, 8]),
            _value("gram", FLOAT, [2, 7, 7]),
            _value("stacked", FLOAT, [2, 7, 4]),
        ],
        [_weight("w_right", 8, 6), _weight("w_left", 5, 7), _weight("w_3d", 2, 8, 4)],
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(2, 7, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["mm_right", "mm_left", "mm_batched", "mm_3d_weight"]
    _assert_integer(quantized, "mm_right", (0,), 1)
    _assert_integer(quantized, "mm_left", (1,), 0)
    _assert_integer(quantized, "mm_batched", (0, 1), None)
    _assert_integer(quantized, "mm_3d_weight", (0,), 1)
    assert _weight_axis(quantized, _node(quantized, "mm_right").input[1]) == 1
    # a stack of weight matrices is per tensor: onnxruntime's QLinearMatMul takes no 1-D per-column scales for it
    assert _weight_axis(quantized, _node(quantized, "mm_3d_weight").input[1]) is None
    assert _sqnr(model, out, feeds) > 30


def test_a_per_channel_axis_forced_on_a_stacked_weight_is_refused(tmp_path):
    model = _save(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w_3d"], ["y"], name="mm_3d_weight")],
        [_value("x", FLOAT, [2, 7, 8])],
        [_value("y", FLOAT, [2, 7, 4])],
        [_weight("w_3d", 2, 8, 4)],
    )
    data, _ = _data(tmp_path, lambda i: {"x": _normal(2, 7, 8)})
    config = tmp_path / "axis.yaml"
    config.write_text("global: {placement: integer}\nop_type: {MatMul: {weight: {axis: 2}}}\n")
    out = tmp_path / "q.onnx"
    with pytest.raises(QtoolError, match="mm_3d_weight: weight w_3d has no per-channel axis"):
        qtool.quantize(model, out, data_dir=data, config_path=config, evaluation=None)
    assert not out.exists()


# -- ops qtool does not quantize -------------------------------------------------------------------


def test_ops_qtool_does_not_quantize_pass_through_untouched_and_are_reported(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Softmax", ["h"], ["p"], name="softmax", axis=-1),
        helper.make_node("Erf", ["h"], ["e"], name="erf"),
        helper.make_node("TopK", ["h", "k"], ["top_values", "top_indices"], name="topk"),
        helper.make_node("Greater", ["h", "zero"], ["positive"], name="greater"),
        helper.make_node("NonZero", ["positive"], ["where_positive"], name="nonzero"),
        helper.make_node("MatMul", ["p", "w2"], ["y"], name="mm2"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, ["N", 8])],
        [
            _value("y", FLOAT, ["N", 4]),
            _value("e", FLOAT, ["N", 8]),
            _value("top_values", FLOAT, ["N", 3]),
            _value("top_indices", TensorProto.INT64, ["N", 3]),
            _value("where_positive", TensorProto.INT64, [2, "M"]),
        ],
        [
            _weight("w", 8, 8, scale=1.0),
            _weight("w2", 8, 4, scale=1.0),
            numpy_helper.from_array(np.array([3], np.int64), "k"),
            numpy_helper.from_array(np.zeros((), np.float32), "zero"),
        ],
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(2, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["mm", "mm2"]
    for name, op in [("softmax", "Softmax"), ("erf", "Erf"), ("topk", "TopK"), ("nonzero", "NonZero")]:
        assert _node(quantized, name).op_type == op  # untouched
    # the Softmax between the two MatMuls runs as QLinearSoftmax: chained, no longer passed through
    assert result.rewrite.chained_nodes == ["softmax"]
    assert result.rewrite.passthrough == {"Erf": 1, "Greater": 1, "NonZero": 1, "TopK": 1}
    assert _sqnr(model, out, feeds) > 20  # y: Softmax's output quantized, then a MatMul on it
    assert quantize_to_dict(result)["passthrough_ops"] == result.rewrite.passthrough
    console = Console(record=True, width=200)
    render_quantize(console, result)
    summary = console.export_text()
    assert "passed through untouched (not quantized by qtool): Erf x1, Greater x1, NonZero x1" in summary


# -- opsets ----------------------------------------------------------------------------------------

NEWEST_OPSET = _newest_common_opset()


@pytest.mark.parametrize("opset", sorted({11, 13, 17, 19, 21, NEWEST_OPSET}))
def test_opsets(tmp_path, opset):
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "g", "gb"], ["logits"], name="head", transB=1),
        helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, ["N", 3, 8, 8])],
        [_value("y", FLOAT, ["N", 5])],
        [_weight("w", 4, 3, 3, 3), _weight("b", 4), _weight("g", 5, 64, scale=0.1), _weight("gb", 5)],
        opset=opset,
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(1, 3, 8, 8)})
    result, quantized, out = _quantize(model, data)
    # 13: per channel; lowered where onnxruntime's QuantizeLinear kernels stop short of the model's opset
    expected = min(max(opset, 13), qdq_kernel_opset("uint8", quantize=True))
    assert (result.prepare.opset_before, result.prepare.opset_after) == (opset, expected)
    assert result.rewrite.quantized_nodes == ["conv", "head"]
    _assert_integer(quantized, "conv", (0,), 1)
    _assert_integer(quantized, "head", (0,), 1)
    assert _sqnr(model, out, feeds) > 25


# -- If / Loop / Scan ------------------------------------------------------------------------------


def _body(name: str, nodes, inputs, outputs) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, inputs, outputs)


def _assert_body_weights_stored(model: Path, quantized: onnx.ModelProto, node: str, weights: tuple[str, ...]) -> None:
    def bodies(n: onnx.NodeProto) -> list[list[str]]:
        return [[m.op_type for m in a.g.node] for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]

    # the bodies keep their nodes (and gain no annotation); only the weights they read are stored quantized
    original, now = _node(onnx.load(str(model)), node), _node(quantized, node)
    assert bodies(now) == bodies(original)
    assert [len(a.g.value_info) for a in now.attribute if a.type == onnx.AttributeProto.GRAPH] == [
        len(a.g.value_info) for a in original.attribute if a.type == onnx.AttributeProto.GRAPH
    ]
    inits = {i.name: i for i in quantized.graph.initializer}
    produced = {o for n in quantized.graph.node for o in n.output}
    read = {name for a in now.attribute if a.type == onnx.AttributeProto.GRAPH for m in a.g.node for name in m.input}
    for name in weights:
        assert name not in inits, name  # no float copy left
        # the body reads the weight restored in the main graph (where a main-graph node reads it too, that node's
        # dequantized copy): stored once
        restored = (f"{name}/restored", f"{name}/dequantized")
        assert any(r.startswith(restored) and r in produced for r in read), (name, read)
        copies = [k for k, i in inits.items() if k.startswith(f"{name}/quantized") and i.data_type == TensorProto.INT8]
        assert len(copies) == 1, copies


def _assert_float_initializers(quantized: onnx.ModelProto, *names: str) -> None:
    inits = {i.name: i for i in quantized.graph.initializer}
    for name in names:  # what a body reads from the outer scope is still there, in float
        assert name in inits and inits[name].data_type == FLOAT, name


def test_if_branches_reading_outer_initializers_that_main_graph_nodes_quantize(tmp_path):
    then_branch = _body(
        "then",
        [helper.make_node("MatMul", ["r", "w"], ["t"], name="then_mm")],  # r and w come from the outer scope
        [],
        [_value("t", FLOAT, ["N", 8])],
    )
    else_branch = _body(
        "else",
        [
            helper.make_node("MatMul", ["x", "w2"], ["e0"], name="else_mm"),
            helper.make_node("Add", ["e0", "h"], ["e"], name="else_add"),
        ],
        [],
        [_value("e", FLOAT, ["N", 8])],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm_main"),  # w is also read by the then branch
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("If", ["flag"], ["branch"], name="if", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("MatMul", ["branch", "w3"], ["y"], name="mm_out"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, ["N", 8]), _value("flag", TensorProto.BOOL, [])],
        [_value("y", FLOAT, ["N", 4]), _value("r", FLOAT, ["N", 8])],
        [_weight("w", 8, 8), _weight("w2", 8, 8), _weight("w3", 8, 4)],
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(2, 8), "flag": np.array(i % 2 == 0)})
    stats = qtool.calibrate(model, data)
    assert {"x", "branch", "e0"} <= set(stats.tensors)  # a branch's tensors too, on the samples that run it
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["mm_main", "mm_out", "else_mm"]
    _assert_integer(quantized, "mm_main", (0,), 1)
    _assert_integer(quantized, "mm_out", (0,), 1)
    reason = dict(result.skipped)["if"]
    assert "else_branch 1 quantized" in reason and "then_branch 0 quantized" in reason
    _assert_branch_weights(quantized, shared="w", moved="w2")
    for flag in (True, False):  # both branches
        assert _sqnr(model, out, [feed for feed in feeds if feed["flag"] == flag]) > 25

    # the default config stores the main graph's w as int8 restored by Cast/Mul (placement storage), w2 in its branch
    stored = tmp_path / "stored.onnx"
    result = qtool.quantize(model, stored, data_dir=data, search=None, evaluation=None)
    assert result.placements == {"storage": 3}
    _assert_branch_weights(onnx.load(str(stored)), shared="w", moved="w2")
    assert _sqnr(model, stored, feeds) > 25


def _assert_branch_weights(quantized: onnx.ModelProto, shared: str, moved: str) -> None:
    """``shared`` (read in the main graph too) stored once there, read by the branch; ``moved`` stored in its branch."""
    inits = {i.name: i for i in quantized.graph.initializer}
    now = _node(quantized, "if")
    bodies = {a.name: a.g for a in now.attribute}
    then_body, else_body = bodies["then_branch"], bodies["else_branch"]
    assert shared not in inits and moved not in inits  # no float copy left
    copies = [k for k, i in inits.items() if k.startswith(f"{shared}/quantized") and i.data_type == TensorProto.INT8]
    assert len(copies) == 1, copies
    produced = {o for n in quantized.graph.node for o in n.output}
    read = {name for m in then_body.node for name in m.input}
    assert any(r.startswith((f"{shared}/restored", f"{shared}/dequantized")) and r in produced for r in read), read
    inside = {i.name: i.data_type for i in else_body.initializer}
    assert inside.get(f"{moved}/quantized") == TensorProto.INT8, inside
    assert not then_body.value_info and not else_body.value_info


def test_loop_body_with_a_matmul_on_an_outer_initializer(tmp_path):
    body = _body(
        "body",
        [
            helper.make_node("MatMul", ["h_in", "w"], ["hw"], name="body_mm"),
            helper.make_node("Tanh", ["hw"], ["h_out"], name="body_tanh"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
        ],
        [_value("i", TensorProto.INT64, []), _value("cond_in", TensorProto.BOOL, []), _value("h_in", FLOAT, ["N", 8])],
        [_value("cond_out", TensorProto.BOOL, []), _value("h_out", FLOAT, ["N", 8])],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h0"], name="mm_main"),
        helper.make_node("Loop", ["trips", "go", "h0"], ["h_final"], name="loop", body=body),
        helper.make_node("MatMul", ["h_final", "w3"], ["y"], name="mm_out"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("x", FLOAT, ["N", 8])],
        [_value("y", FLOAT, ["N", 4])],
        [
            _weight("w", 8, 8, scale=0.5),
            _weight("w3", 8, 4),
            numpy_helper.from_array(np.array(3, np.int64), "trips"),
            numpy_helper.from_array(np.array(True), "go"),
        ],
    )
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(2, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["mm_main", "mm_out"]
    _assert_integer(quantized, "mm_main", (0,), 1)
    _assert_integer(quantized, "mm_out", (0,), 1)
    assert "body 0 quantized" in dict(result.skipped)["loop"]  # its weight is the main graph's: stored there once
    assert "1 weight it shares stored once" in dict(result.skipped)["loop"]
    _assert_body_weights_stored(model, quantized, "loop", ("w",))
    assert _sqnr(model, out, feeds) > 25


def test_scan_body_with_a_matmul_on_an_outer_initializer(tmp_path):
    body = _body(
        "body",
        [
            helper.make_node("MatMul", ["x_t", "w"], ["xw"], name="body_mm"),
            helper.make_node("Add", ["state_in", "xw"], ["state_out"], name="body_add"),
            helper.make_node("Relu", ["xw"], ["out_t"], name="body_relu"),
        ],
        [_value("state_in", FLOAT, [8]), _value("x_t", FLOAT, [8])],
        [_value("state_out", FLOAT, [8]), _value("out_t", FLOAT, [8])],
    )
    nodes = [
        helper.make_node("MatMul", ["seq", "w"], ["proj"], name="mm_main"),
        helper.make_node("Scan", ["state0", "seq"], ["final", "outs"], name="scan", body=body, num_scan_inputs=1),
        helper.make_node("MatMul", ["outs", "w3"], ["y"], name="mm_out"),
    ]
    model = _save(
        tmp_path,
        nodes,
        [_value("seq", FLOAT, ["T", 8])],
        [_value("y", FLOAT, ["T", 4]), _value("final", FLOAT, [8]), _value("proj", FLOAT, ["T", 8])],
        [_weight("w", 8, 8), _weight("w3", 8, 4), numpy_helper.from_array(np.zeros(8, np.float32), "state0")],
    )
    data, feeds = _data(tmp_path, lambda i: {"seq": _normal(5, 8)})
    result, quantized, out = _quantize(model, data)
    assert result.rewrite.quantized_nodes == ["mm_main", "mm_out"]
    _assert_integer(quantized, "mm_main", (0,), 1)
    _assert_integer(quantized, "mm_out", (0,), 1)
    assert "body 0 quantized" in dict(result.skipped)["scan"]  # its weight is the main graph's: stored there once
    _assert_body_weights_stored(model, quantized, "scan", ("w",))
    assert _sqnr(model, out, feeds) > 25
