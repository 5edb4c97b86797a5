"""Integer chains: the unweighted ops between integer kernels fuse into onnxruntime's 8-bit kernels."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.graph.index import GraphView
from qtool.quantization.plan.roles import FUSED_KERNELS, PASS_THROUGH

SIZE, CHANNELS = 16, 8


class _Builder:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(3)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], out: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv(self, x: str, out: str, cin: int = CHANNELS, cout: int = CHANNELS, k: int = 3) -> str:
        w = self.rng.normal(0, np.sqrt(2.0 / (cin * k * k)), (cout, cin, k, k)).astype(np.float32)
        b = self.rng.normal(0, 0.1, cout).astype(np.float32)
        pads = [k // 2] * 4
        return self.node("Conv", [x, self.const(out + ".w", w), self.const(out + ".b", b)], out, pads=pads)

    def model(self, out: str, shape: list[int]) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "chains",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)],
            self.inits,
        )
        return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])


def between_convs(op: str) -> onnx.ModelProto:
    """x -> Conv -> Conv -> ``op`` -> Conv -> y: the op sits between two integer kernels."""
    b = _Builder()
    first = b.conv(b.conv("x", "c0", cin=3), "c1")
    if op in ("Add", "Mul"):
        mid = b.node(op, [first, "c0"], "mid")
    elif op == "Concat":
        mid = b.node(op, [first, "c0"], "mid", axis=1)
    elif op == "Split":
        halves = b.const("halves", np.array([CHANNELS // 2] * 2, np.int64))
        b.nodes.append(helper.make_node("Split", [first, halves], ["s0", "s1"], name="mid", axis=1))
        mid = b.node("Concat", ["s1", "s0"], "swap", axis=1)
    elif op in ("MaxPool", "AveragePool"):
        mid = b.node(op, [first], "mid", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    elif op == "GlobalAveragePool":
        mid = b.node("Add", [first, b.node(op, [first], "pooled")], "mid")
    elif op == "Resize":
        scales = b.const("scales", np.array([1, 1, 2, 2], np.float32))
        up = b.node(op, [first, "", scales], "mid", mode="nearest")
        mid = b.node("MaxPool", [up], "down", kernel_shape=[2, 2], strides=[2, 2])
    elif op in ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice"):
        mid = _shape_op(b, op, first)
    elif op == "Softmax":
        mid = b.node(op, [first], "mid", axis=1)
    elif op == "LeakyRelu":
        mid = b.node(op, [first], "mid", alpha=0.1)
    else:
        mid = b.node(op, [first], "mid")
    channels = 2 * CHANNELS if op == "Concat" else CHANNELS
    b.conv(mid, "y", cin=channels)
    return b.model("y", [1, CHANNELS, SIZE, SIZE])


def _shape_op(b: _Builder, op: str, x: str) -> str:
    """A data-moving op and its inverse, so the next Conv reads the original layout."""
    if op == "Reshape":
        flat = b.node(op, [x, b.const("flat", np.array([1, CHANNELS, -1], np.int64))], "mid")
        return b.node(op, [flat, b.const("restore", np.array([1, CHANNELS, SIZE, SIZE], np.int64))], "back")
    if op == "Transpose":
        swapped = b.node(op, [x], "mid", perm=[0, 1, 3, 2])
        return b.node(op, [swapped], "back", perm=[0, 1, 3, 2])
    if op == "Flatten":
        flat = b.node(op, [x], "mid", axis=1)
        return b.node("Reshape", [flat, b.const("restore", np.array([1, CHANNELS, SIZE, SIZE], np.int64))], "back")
    if op == "Squeeze":
        added = b.node("Unsqueeze", [x, b.const("axis", np.array([0], np.int64))], "added")
        return b.node(op, [added, b.const("axis0", np.array([0], np.int64))], "mid")
    if op == "Unsqueeze":
        added = b.node(op, [x, b.const("axis", np.array([0], np.int64))], "mid")
        return b.node("Squeeze", [added, b.const("axis0", np.array([0], np.int64))], "back")
    starts, ends, axes = (b.const(n, np.array(v, np.int64)) for n, v in (("st", [0]), ("en", [SIZE]), ("ax", [2])))
    return b.node(op, [x, starts, ends, axes], "mid")


def silu_block() -> onnx.ModelProto:
    """Conv + SiLU, a residual Add, a Concat and an SPPF-style MaxPool, then a float head after the last Conv."""
    b = _Builder()
    x = b.conv("x", "c0", cin=3)
    x = b.node("Mul", [x, b.node("Sigmoid", [x], "sig0")], "silu0")
    y = b.conv(x, "c1")
    y = b.node("Mul", [y, b.node("Sigmoid", [y], "sig1")], "silu1")
    res = b.node("Add", [x, y], "res")
    pool = b.node("MaxPool", [res], "pool", kernel_shape=[5, 5], pads=[2, 2, 2, 2])
    cat = b.node("Concat", [res, pool], "cat", axis=1)
    z = b.conv(cat, "c2", cin=2 * CHANNELS)
    head = b.node("Sigmoid", [z], "head")
    b.node("Reshape", [head, b.const("shape", np.array([1, CHANNELS, -1], np.int64))], "y")
    return b.model("y", [1, CHANNELS, SIZE * SIZE])


def relu6_block(opset: int) -> onnx.ModelProto:
    """MobileNetV2's inverted residual as torch exports it (BatchNormalization folded): Conv -> Clip(0, 6) ... -> Add.

    Opset 10 writes Clip's bounds as attributes, 11 on as inputs. The head pools, flattens and ends in a Gemm.
    """
    b = _Builder()
    stem = b.conv("x", "c0", cin=3)
    six = [b.const("zero", np.array(0.0, np.float32)), b.const("six", np.array(6.0, np.float32))]

    def relu6(x: str, out: str) -> str:
        if opset >= 11:
            return b.node("Clip", [x, *six], out)
        return b.node("Clip", [x], out, min=0.0, max=6.0)

    x = relu6(stem, "r0")
    expanded = relu6(b.conv(x, "c1", cout=2 * CHANNELS, k=1), "r1")
    w = b.rng.normal(0, 0.3, (2 * CHANNELS, 1, 3, 3)).astype(np.float32)
    depthwise = b.node("Conv", [expanded, b.const("dw.w", w)], "dw", pads=[1, 1, 1, 1], group=2 * CHANNELS)
    projected = b.conv(relu6(depthwise, "r2"), "c2", cin=2 * CHANNELS, k=1)
    residual = b.node("Add", [x, projected], "res")
    pooled = b.node("Flatten", [b.node("GlobalAveragePool", [relu6(b.conv(residual, "c3"), "r3")], "gap")], "flat")
    weight = b.rng.normal(0, 0.3, (10, CHANNELS)).astype(np.float32)
    b.node("Gemm", [pooled, b.const("fc.w", weight), b.const("fc.b", np.zeros(10, np.float32))], "y", transB=1)
    model = b.model("y", [1, 10])
    model.opset_import[0].version = opset
    return model


def _data(folder, count: int, seed: int):
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.save(folder / f"{i:03d}.npy", rng.uniform(-1, 1, (3, SIZE, SIZE)).astype(np.float32))
    return folder


def _quantize(model: onnx.ModelProto, tmp_path, config: str = "global: {placement: integer}\n"):
    source, out, config_path = tmp_path / "model.onnx", tmp_path / "q.onnx", tmp_path / "config.yaml"
    onnx.save(model, source)
    config_path.write_text("version: 1\n" + config)
    calib = _data(tmp_path / "calib", 8, 0)
    result = qtool.quantize(source, out, data_dir=calib, config_path=config_path, search=None, evaluation=None)
    return source, out, result


def _optimized(path, tmp_path) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp_path / "optimized.onnx"))


def _sqnr(source, out, tmp_path) -> float:
    reference = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    candidate = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    signal = noise = 0.0
    for path in sorted(_data(tmp_path / "eval", 8, 1).glob("*.npy")):
        feed = {"x": np.load(path)[None]}
        r, c = reference.run(None, feed)[0].astype(np.float64), candidate.run(None, feed)[0].astype(np.float64)
        signal, noise = signal + float((r * r).sum()), noise + float(((r - c) ** 2).sum())
    return 10 * np.log10(signal / noise)


OPS = sorted(set(FUSED_KERNELS) | PASS_THROUGH)


@pytest.mark.parametrize("op", OPS)
def test_each_op_between_integer_kernels_runs_on_8_bit_values(tmp_path, op):
    source, out, result = _quantize(between_convs(op), tmp_path)
    ops = collections.Counter(n.op_type for n in _optimized(out, tmp_path).graph.node)
    # one QuantizeLinear on the model's input, one DequantizeLinear on its output: nothing between goes to float
    assert (ops["QuantizeLinear"], ops["DequantizeLinear"]) == (1, 1), ops
    assert result.boundaries == {"QuantizeLinear": 1, "DequantizeLinear": 1}
    if op in FUSED_KERNELS:
        assert ops[FUSED_KERNELS[op]] >= 1, ops
        assert result.kernels[FUSED_KERNELS[op]] >= 1
    else:
        assert result.kernels[f"int8 {op}"] >= 1
    assert ops["QLinearConv"] == 3
    assert _sqnr(source, out, tmp_path) > 25


@pytest.mark.parametrize("opset", [10, 17])
def test_a_relu6_network_stays_integer_from_its_input_to_its_logits(tmp_path, opset):
    """Each ReLU6 is quantized past (its grid within [0, 6]): onnxruntime drops it and fuses its Conv."""
    source, out, result = _quantize(relu6_block(opset), tmp_path)
    ops = collections.Counter(n.op_type for n in _optimized(out, tmp_path).graph.node)
    assert ops["Clip"] == 0 and ops["QLinearConv"] == 5 and ops["QLinearAdd"] == 1, ops
    assert ops["QLinearGlobalAveragePool"] == 1 and ops["QGemm"] == 1, ops
    assert (ops["QuantizeLinear"], ops["DequantizeLinear"]) == (1, 0), ops  # the Gemm writes float logits
    assert result.boundaries == {"QuantizeLinear": 1, "DequantizeLinear": 0}
    assert result.kernels["QLinearConv"] == 5
    assert _sqnr(source, out, tmp_path) > 25


def test_a_silu_network_stays_integer_to_its_last_conv_and_its_head_stays_float(tmp_path):
    source, out, _ = _quantize(silu_block(), tmp_path)
    optimized = _optimized(out, tmp_path)
    ops = collections.Counter(n.op_type for n in optimized.graph.node)
    assert ops["QLinearSigmoid"] == 2 and ops["QLinearMul"] == 2 and ops["QLinearAdd"] == 1, ops
    assert ops["QLinearConcat"] == 1 and ops["QLinearConv"] == 3, ops
    assert ops["Sigmoid"] == 1 and ops["Reshape"] == 1  # the head after the last Conv: float, as written
    assert (ops["QuantizeLinear"], ops["DequantizeLinear"]) == (1, 1), ops
    assert _sqnr(source, out, tmp_path) > 25
    # the MaxPool's output shares its input's scale and zero point (onnxruntime drops the pair only then)
    written = onnx.load(str(out))
    view = GraphView(written)
    values = {i.name: numpy_helper.to_array(i) for i in written.graph.initializer}

    def qparams(tensor: str) -> tuple[float, int]:
        quantize = next(n for n in view.input_readers(tensor) if n.op_type == "QuantizeLinear")
        return float(values[quantize.input[1]]), int(values[quantize.input[2]])

    pool = next(n for n in written.graph.node if n.op_type == "MaxPool")
    dequantize = view.producer(pool.input[0])
    assert dequantize is not None and dequantize.op_type == "DequantizeLinear"
    assert qparams(pool.output[0]) == (float(values[dequantize.input[1]]), int(values[dequantize.input[2]]))


def test_a_node_kept_float_breaks_the_chain_there(tmp_path):
    config = "global: {placement: integer}\nnode_name: {res: null}\n"
    _, out, result = _quantize(silu_block(), tmp_path, config)
    ops = collections.Counter(n.op_type for n in _optimized(out, tmp_path).graph.node)
    assert ops["QLinearAdd"] == 0 and ops["Add"] == 1, ops
    assert result.boundaries["DequantizeLinear"] >= 2 and result.boundaries["QuantizeLinear"] >= 2


def test_storage_placement_has_no_chains(tmp_path):
    _, out, result = _quantize(silu_block(), tmp_path, "global: {placement: storage}\n")
    ops = collections.Counter(n.op_type for n in _optimized(out, tmp_path).graph.node)
    assert not any(op.startswith("QLinear") for op in ops), ops
    assert result.placements == {"storage": 3}
