from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.session import create_session
from qtool.graph.weights import Weights, is_detached
from qtool.quantization.algorithms.transforms.equalization import EqualizedPair, equalize


def _everything(name: str) -> bool:
    return True


class _Builder:
    """A small float model: each layer names its output ``<name>.y`` and its constants ``<name>.w`` / ``.b``."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        return name

    def conv(self, name: str, x: str, weight: np.ndarray, bias: np.ndarray | None = None, **attrs: object) -> str:
        inputs = [x, self.const(f"{name}.w", weight)]
        if bias is not None:
            inputs.append(self.const(f"{name}.b", bias))
        return self.node("Conv", inputs, name, **attrs)

    def node(self, op: str, inputs: list[str], name: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [f"{name}.y"], name=name, **attrs))
        return f"{name}.y"

    def model(self, output: str, x_shape: tuple[int, ...] = (2, 3, 10, 12), opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        return model


def _run(model: onnx.ModelProto, x: np.ndarray, store: Weights | None = None, output: str | None = None) -> np.ndarray:
    if output is not None:
        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
        exposed.graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, None))
        model = exposed
    session = create_session(model, "the test model", weights=store)
    return np.asarray(session.run([output] if output else None, {"x": x})[0])


def _assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, x: np.ndarray, store: Weights) -> None:
    reference, equalized = _run(before, x, store), _run(after, x, store)
    np.testing.assert_allclose(equalized, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())


def _input(shape: tuple[int, ...] = (2, 3, 10, 12), seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _weight(model: onnx.ModelProto, node: str, slot: int = 1, store: Weights | None = None) -> np.ndarray:
    name = next(n for n in model.graph.node if n.name == node).input[slot]
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return (store or Weights()).value(tensor)


def _spread(channels: int) -> np.ndarray:
    """Per-channel ranges from 0.01 to 100, shuffled."""
    return np.random.default_rng(3).permutation(np.logspace(-2, 2, channels))


def _conv_relu_conv(activation: str = "Relu", seed: int = 0, **attrs: object) -> tuple[onnx.ModelProto, _Builder]:
    b = _Builder(seed)
    ranges = _spread(8)
    w1 = b.rng.normal(size=(8, 3, 3, 3)) * ranges[:, None, None, None]
    y = b.conv("c1", "x", w1, b.rng.normal(size=8) * ranges, pads=[1, 1, 1, 1])
    if activation == "PRelu":
        y = b.node("PRelu", [y, b.const("slope", b.rng.uniform(0.05, 0.5, (8, 1, 1)))], "act")
    elif activation:
        y = b.node(activation, [y], "act", **attrs)
    w2 = b.rng.normal(size=(5, 8, 1, 1)) / ranges[None, :, None, None]
    return b.model(b.conv("c2", y, w2, b.rng.normal(size=5))), b


def test_conv_relu_conv_keeps_outputs_evens_ranges_and_leaves_the_input_alone():
    model, _ = _conv_relu_conv()
    original = model.SerializeToString()
    store = Weights()
    equalized, report = equalize(model, store, _everything)
    assert model.SerializeToString() == original
    assert report.pairs == (EqualizedPair("c1", "c2", "Relu"),)
    assert report.skipped == () and report.absorbed == () and 1 <= report.sweeps <= 20
    _assert_same_outputs(model, equalized, _input(), store)
    r1 = np.abs(_weight(equalized, "c1")).reshape(8, -1).max(axis=1)
    r2 = np.abs(_weight(equalized, "c2")).max(axis=(0, 2, 3))
    np.testing.assert_allclose(r1, r2, rtol=1e-5)
    assert [n.input[1] for n in equalized.graph.node if n.op_type == "Conv"] == ["c1.w/equalized", "c2.w/equalized"]
    assert {t.name for t in equalized.graph.initializer} == {
        "c1.w/equalized",
        "c1.b/equalized",
        "c2.w/equalized",
        "c2.b/equalized",
    }


@pytest.mark.parametrize(
    ("activation", "attrs", "label"),
    [
        ("PRelu", {}, "PRelu"),
        ("LeakyRelu", {"alpha": 0.2}, "LeakyRelu"),
        ("MaxPool", {"kernel_shape": [2, 2]}, "MaxPool"),
        ("", {}, ""),
    ],
)
def test_scale_equivariant_ops_between_the_layers(activation, attrs, label):
    model, _ = _conv_relu_conv(activation, **attrs)
    store = Weights()
    equalized, report = equalize(model, store, _everything)
    assert report.pairs == (EqualizedPair("c1", "c2", label),)
    _assert_same_outputs(model, equalized, _input(), store)


def test_clip_with_min_zero_and_no_max_is_a_relu():
    b = _Builder()
    y = b.conv("c1", "x", b.rng.normal(size=(4, 3, 3, 3)) * [[[[0.01]]], [[[1]]], [[[10]]], [[[3]]]])
    y = b.node("Clip", [y, b.const("zero", np.float32(0))], "clip")
    model = b.model(b.conv("c2", y, b.rng.normal(size=(2, 4, 1, 1))))
    store = Weights()
    equalized, report = equalize(model, store, _everything)
    assert report.pairs == (EqualizedPair("c1", "c2", "Clip"),)
    _assert_same_outputs(model, equalized, _input(), store)


def _relu6_model() -> onnx.ModelProto:
    b = _Builder()
    y = b.conv("c1", "x", b.rng.normal(size=(4, 3, 3, 3)))
    y = b.node("Clip", [y, b.const("lo", np.float32(0)), b.const("hi", np.float32(6))], "relu6")
    return b.model(b.conv("c2", y, b.rng.normal(size=(2, 4, 1, 1))))


def test_a_relu6_pair_is_skipped_unless_clip_pairs_allows_it():
    model = _relu6_model()
    equalized, report = equalize(model, Weights(), _everything)
    assert report.pairs == ()
    assert [(s.first, s.second) for s in report.skipped] == [("c1", "c2")]
    assert "clip_pairs" in report.skipped[0].reason
    assert equalized.SerializeToString() == model.SerializeToString()
    _, allowed = equalize(model, Weights(), _everything, clip_pairs=True)
    assert allowed.pairs == (EqualizedPair("c1", "c2", "Clip"),)


def test_a_shared_weight_is_not_rescaled():
    b = _Builder()
    weight = b.const("shared", b.rng.normal(size=(3, 3, 1, 1)))
    y = b.node("Conv", ["x", weight], "c1")
    y = b.node("Relu", [y], "act")
    model = b.model(b.node("Conv", [y, weight], "c2"))
    equalized, report = equalize(model, Weights(), _everything)
    assert report.pairs == ()
    assert len(report.skipped) == 1 and "'shared' is shared with 1 other reader" in report.skipped[0].reason
    assert equalized.SerializeToString() == model.SerializeToString()


def test_a_branching_intermediate_tensor_is_skipped():
    b = _Builder()
    y = b.node("Relu", [b.conv("c1", "x", b.rng.normal(size=(4, 3, 1, 1)))], "act")
    left = b.conv("c2", y, b.rng.normal(size=(4, 4, 1, 1)))
    right = b.conv("c3", y, b.rng.normal(size=(4, 4, 1, 1)))
    model = b.model(b.node("Add", [left, right], "sum"))
    _, report = equalize(model, Weights(), _everything)
    assert report.pairs == ()
    assert [(s.first, s.second, s.reason) for s in report.skipped] == [("c1", "c2", "'act.y' has 2 readers")]


def test_unselected_nodes_are_skipped_with_a_reason():
    model, _ = _conv_relu_conv()
    _, report = equalize(model, Weights(), frozenset({"c1"}))
    assert report.pairs == () and report.skipped[0].reason == "c2 is not selected"


def _mobilenet_block(seed: int = 0) -> onnx.ModelProto:
    """Pointwise -> Relu -> depthwise (wild channel ranges) -> Relu -> pointwise, as in MobileNet."""
    b = _Builder(seed)
    ranges = _spread(16)
    y = b.conv("pw1", "x", b.rng.normal(size=(16, 3, 1, 1)), b.rng.normal(size=16) * 0.1)
    y = b.node("Relu", [y], "relu1")
    dw = b.rng.normal(size=(16, 1, 3, 3)) * ranges[:, None, None, None]
    y = b.conv("dw", y, dw, b.rng.normal(size=16) * ranges * 0.1, group=16, pads=[1, 1, 1, 1])
    y = b.node("Relu", [y], "relu2")
    return b.model(b.conv("pw2", y, b.rng.normal(size=(8, 16, 1, 1)) / ranges[None, :, None, None]))


def test_a_depthwise_chain_is_two_pairs_balanced_together():
    model = _mobilenet_block()
    store = Weights()
    equalized, report = equalize(model, store, _everything, iterations=100, tolerance=1e-6)
    assert report.pairs == (EqualizedPair("pw1", "dw", "Relu"), EqualizedPair("dw", "pw2", "Relu"))
    assert report.sweeps < 100
    _assert_same_outputs(model, equalized, _input(), store)
    pw1, dw, pw2 = (_weight(equalized, name) for name in ("pw1", "dw", "pw2"))
    np.testing.assert_allclose(np.abs(pw1).max(axis=(1, 2, 3)), np.abs(dw).max(axis=(1, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(np.abs(dw).max(axis=(1, 2, 3)), np.abs(pw2).max(axis=(0, 2, 3)), rtol=1e-5)


def test_grouped_convolutions_keep_their_outputs():
    b = _Builder()
    y = b.conv("g1", "x", b.rng.normal(size=(6, 1, 3, 3)) * _spread(6)[:, None, None, None], group=3)
    y = b.node("Relu", [y], "act")
    model = b.model(b.conv("g2", y, b.rng.normal(size=(4, 3, 1, 1)), b.rng.normal(size=4), group=2))
    store = Weights()
    equalized, report = equalize(model, store, _everything)
    assert report.pairs == (EqualizedPair("g1", "g2", "Relu"),)
    _assert_same_outputs(model, equalized, _input(), store)


@pytest.mark.parametrize(("trans_b", "bias_shape"), [(1, (6,)), (0, ()), (0, (1, 6))])
def test_gemm_relu_gemm(trans_b, bias_shape):
    b = _Builder()
    w1 = b.rng.normal(size=(6, 5)) * _spread(6)[:, None]
    w1 = w1 if trans_b else w1.T
    bias = b.rng.normal(size=bias_shape)
    y = b.node("Gemm", ["x", b.const("g1.w", w1), b.const("g1.b", bias)], "g1", transB=trans_b, alpha=0.5, beta=2.0)
    y = b.node("Relu", [y], "act")
    model = b.model(b.node("Gemm", [y, b.const("g2.w", b.rng.normal(size=(6, 3)))], "g2"), x_shape=(4, 5))
    store = Weights()
    equalized, report = equalize(model, store, _everything)
    assert report.pairs == (EqualizedPair("g1", "g2", "Relu"),)
    _assert_same_outputs(model, equalized, _input((4, 5)), store)


def test_matmul_with_its_bias_add_then_matmul():
    b = _Builder()
    y = b.node("MatMul", ["x", b.const("m1.w", b.rng.normal(size=(5, 6)) * _spread(6))], "m1")
    y = b.node("Add", [b.const("m1.b", b.rng.normal(size=6)), y], "m1_bias")
    y = b.node("LeakyRelu", [y], "act")
    model = b.model(b.node("MatMul", [y, b.const("m2.w", b.rng.normal(size=(6, 3)))], "m2"), x_shape=(2, 4, 5))
    store = Weights()
    equalized, report = equalize(model, store, _everything)
    assert report.pairs == (EqualizedPair("m1", "m2", "LeakyRelu"),)
    _assert_same_outputs(model, equalized, _input((2, 4, 5)), store)


def _fake_quantize_weights(model: onnx.ModelProto, store: Weights) -> onnx.ModelProto:
    """Every Conv weight rounded to symmetric per-tensor int8, as a float model."""
    quantized = onnx.ModelProto()
    quantized.CopyFrom(model)
    weights = {node.input[1] for node in quantized.graph.node if node.op_type == "Conv"}
    for tensor in quantized.graph.initializer:
        if tensor.name in weights:
            values = store.value(tensor)
            scale = np.abs(values).max() / 127
            tensor.CopyFrom(numpy_helper.from_array((np.round(values / scale) * scale).astype(np.float32), tensor.name))
    return quantized


def _sqnr(reference: np.ndarray, approximation: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - approximation) ** 2)))


@pytest.mark.parametrize("build", [_conv_relu_conv, _mobilenet_block], ids=["conv", "depthwise"])
def test_per_tensor_int8_weights_gain_at_least_10_db(build):
    built = build()
    model = built[0] if isinstance(built, tuple) else built
    store = Weights()
    x = _input(seed=11)
    reference = _run(model, x)
    equalized, _ = equalize(model, store, _everything)
    before = _sqnr(reference, _run(_fake_quantize_weights(model, store), x))
    after = _sqnr(reference, _run(_fake_quantize_weights(equalized, store), x))
    assert after >= before + 10, (before, after)


def _absorbing_model(pads: list[int]) -> onnx.ModelProto:
    b = _Builder()
    bias = np.array([5.0, 8.0, -1.0, 6.0])  # three channels the Relu never clips
    y = b.node("Relu", [b.conv("c1", "x", b.rng.normal(size=(4, 3, 1, 1)) * 0.3, bias)], "act")
    return b.model(b.conv("c2", y, b.rng.normal(size=(2, 4, 3, 3)), pads=pads))


def test_high_bias_absorption_keeps_outputs_and_narrows_the_activation():
    model = _absorbing_model([0, 0, 0, 0])
    x = _input()
    minimum = _run(model, x, output="c1.y").min(axis=(0, 2, 3))
    assert (minimum[[0, 1, 3]] > 2).all()
    store = Weights()
    equalized, report = equalize(model, store, _everything, channel_min={"c1.y": minimum})
    assert report.absorbed == ("c1",)
    _assert_same_outputs(model, equalized, x, store)
    assert np.abs(_run(equalized, x, store, "act.y")).max() < 0.7 * np.abs(_run(model, x, output="act.y")).max()
    assert "c2/bias" in {t.name for t in equalized.graph.initializer}  # c2 had no bias: one was added


def test_no_bias_is_absorbed_into_a_padded_conv():
    model = _absorbing_model([1, 1, 1, 1])
    minimum = _run(model, _input(), output="c1.y").min(axis=(0, 2, 3))
    _, report = equalize(model, Weights(), _everything, channel_min={"c1.y": minimum})
    assert report.absorbed == () and len(report.pairs) == 1
    assert "pads with zeros" in report.skipped[0].reason


def test_detached_weights_get_new_arrays_and_the_old_ones_stay():
    b = _Builder()
    y = b.node("Relu", [b.conv("c1", "x", b.rng.normal(size=(64, 3, 3, 3)) * _spread(64)[:, None, None, None])], "a")
    model = b.model(b.conv("c2", y, b.rng.normal(size=(64, 64, 3, 3))))
    store = Weights()
    assert store.detach(model.graph) == 1  # c2.w: 147 kB
    kept = store.arrays["c2.w"].copy()
    equalized, _ = equalize(model, store, _everything)
    np.testing.assert_array_equal(store.arrays["c2.w"], kept)
    new = next(t for t in equalized.graph.initializer if t.name == "c2.w/equalized")
    assert is_detached(new) and store.arrays["c2.w/equalized"].shape == (64, 64, 3, 3)
    _assert_same_outputs(model, equalized, _input(), store)


def test_same_input_same_bytes_and_a_dead_channel_stays_finite():
    model, _ = _conv_relu_conv()
    dead = numpy_helper.to_array(model.graph.initializer[0]).copy()
    dead[2] = 0
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(dead, "c1.w"))
    first, first_report = equalize(model, Weights(), _everything)
    second, second_report = equalize(model, Weights(), _everything)
    assert first.SerializeToString() == second.SerializeToString() and first_report == second_report
    assert all(np.isfinite(numpy_helper.to_array(t)).all() for t in first.graph.initializer)
    _assert_same_outputs(model, first, _input(), Weights())
