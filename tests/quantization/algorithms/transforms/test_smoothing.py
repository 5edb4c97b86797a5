from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.graph.session import create_session
from qtool.graph.weights import Weights, is_detached
from qtool.numerics.qparams import QUANT_TYPES, compute_qparams, dequantize, quantize, weight_range
from qtool.quantization.algorithms.transforms.smoothing import SmoothingReport, smooth
from qtool.quantization.algorithms.transforms.smoothing_scales import channel_absmax, outlier_ratio, smoothing_scales
from tests.conftest import calib_dir, sample

UINT8, INT8 = QUANT_TYPES["uint8"], QUANT_TYPES["int8"]
OUTLIERS = [1, 7, 12]
K = 16
_OUTPUT_TYPES = {"shape": TensorProto.INT64}


def _model(nodes, inputs, outputs, initializers, opset=17) -> onnx.ModelProto:
    """A float model; an output named "shape" is int64."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, _OUTPUT_TYPES.get(n, TensorProto.FLOAT), None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)  # value_info, as a prepared model has
    onnx.checker.check_model(model)
    return model


def _matmul(x_shape: list[int], w: np.ndarray) -> onnx.ModelProto:
    """y = x @ w, one node named "mm"."""
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"x": x_shape}, ["y"], {"w": w})


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray], store: Weights | None = None) -> list[np.ndarray]:
    return create_session(model, "the test model", weights=store).run(None, feed)


def _absmax(model: onnx.ModelProto, feed: dict[str, np.ndarray], store: Weights | None = None) -> dict:
    """Every float tensor's per-channel abs max, from the model with all tensors exposed."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    names = [o for n in exposed.graph.node for o in n.output if o not in {v.name for v in exposed.graph.output}]
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    values = _run(exposed, feed, store)
    every = [o.name for o in exposed.graph.output]
    named = [*zip(every, values, strict=True), *feed.items()]
    return {name: channel_absmax(value) for name, value in named if value.ndim and value.dtype.kind == "f"}


def _outlier_input(rng: np.random.Generator, shape: tuple[int, ...], factor: float = 50.0) -> np.ndarray:
    x = rng.normal(size=shape).astype(np.float32)
    x[..., OUTLIERS] *= factor
    return x


def _outlier_gamma(rng: np.random.Generator) -> np.ndarray:
    gamma = rng.uniform(0.5, 1.5, K)
    gamma[OUTLIERS] *= 40.0
    return gamma


def _smooth_and_compare(model, feed, nodes=None, store=None, **kwargs) -> tuple[onnx.ModelProto, SmoothingReport]:
    store = store or Weights()
    names = nodes if nodes is not None else frozenset(n.name for n in model.graph.node)
    smoothed, report = smooth(model, store, _absmax(model, feed, store), names, **{"alpha": 0.5, **kwargs})
    onnx.checker.check_model(store.embedded(smoothed))
    for want, got in zip(_run(model, feed, store), _run(smoothed, feed, store), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    return smoothed, report


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _qkv(rng: np.random.Generator) -> onnx.ModelProto:
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["t"], name="ln")]
    inits = {"gamma": _outlier_gamma(rng), "beta": rng.normal(size=K)}
    for p in "qkv":
        nodes += [
            helper.make_node("MatMul", ["t", f"w{p}"], [f"{p}_mm"], name=f"{p}/matmul"),
            helper.make_node("Add", [f"{p}_mm", f"b{p}"], [p], name=f"{p}/add"),
        ]
        inits |= {f"w{p}": rng.normal(size=(K, 8)), f"b{p}": rng.normal(size=8)}
    return _model(nodes, {"x": [4, 6, K]}, ["q", "k", "v"], inits)


def test_layernorm_feeding_q_k_v_absorbs_the_scale():
    rng = np.random.default_rng(0)
    model = _qkv(rng)
    smoothed, report = _smooth_and_compare(model, {"x": rng.normal(size=(4, 6, K)).astype(np.float32)})
    (group,) = report.groups
    assert group.tensor == "t" and group.nodes == ("q/matmul", "k/matmul", "v/matmul")
    assert group.folded_into == "ln" and group.folded_chain == ("ln",) and group.outlier_ratio > 5
    assert _ops(smoothed) == _ops(model)  # nothing inserted
    assert {i.name for i in smoothed.graph.initializer}.isdisjoint({"gamma", "beta", "wq", "wk", "wv"})


@pytest.mark.parametrize("bias", [False, True])
def test_matmul_feeding_matmul_absorbs_the_scale_in_its_columns(bias):
    rng = np.random.default_rng(1)
    w1 = rng.normal(size=(K, K))
    w1[:, OUTLIERS] *= 30.0  # y gets outlier channels
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y_mm" if bias else "y"], name="mm1")]
    inits = {"w1": w1, "w2": rng.normal(size=(K, 8))}
    if bias:
        nodes.append(helper.make_node("Add", ["b1", "y_mm"], ["y"], name="add1"))
        inits["b1"] = rng.normal(size=K)
    nodes.append(helper.make_node("MatMul", ["y", "w2"], ["out"], name="mm2"))
    model = _model(nodes, {"x": [32, K]}, ["out"], inits)
    smoothed, report = _smooth_and_compare(model, {"x": _outlier_input(rng, (32, K))})
    groups = {g.tensor: g for g in report.groups}
    assert groups["y"].folded_chain == (("add1", "mm1") if bias else ("mm1",))
    assert groups["x"].folded_into == ""  # a graph input: a Mul is inserted
    assert _ops(smoothed)["Mul"] == 1
    assert "w1" not in {i.name for i in smoothed.graph.initializer}  # both groups rescaled it: one copy left


def test_gemm_with_transposed_weights_on_both_sides():
    rng = np.random.default_rng(2)
    b1 = rng.normal(size=(K, K))
    b1[OUTLIERS] *= 30.0  # transB=1: rows are output channels
    nodes = [
        helper.make_node("Gemm", ["x", "b1", "c1"], ["y"], name="gemm1", transB=1, alpha=0.7, beta=1.3),
        helper.make_node("Gemm", ["y", "b2", "c2"], ["out"], name="gemm2", transB=1),
    ]
    inits = {"b1": b1, "c1": rng.normal(size=(1, K)), "b2": rng.normal(size=(8, K)), "c2": rng.normal(size=8)}
    model = _model(nodes, {"x": [32, K]}, ["out"], inits)
    _, report = _smooth_and_compare(model, {"x": _outlier_input(rng, (32, K))})
    groups = {g.tensor: g for g in report.groups}
    assert groups["y"].folded_into == "gemm1" and groups["x"].folded_into == ""


def test_a_reader_outside_the_group_keeps_the_original_tensor():
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["t"], name="ln"),
        helper.make_node("MatMul", ["t", "w"], ["out"], name="mm"),
        helper.make_node("MatMul", ["t", "w"], ["other"], name="mm_float"),  # same weight, not selected
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
    ]
    inits = {"gamma": _outlier_gamma(rng), "beta": rng.normal(size=K), "w": rng.normal(size=(K, 8))}
    model = _model(nodes, {"x": [8, K]}, ["out", "other", "r"], inits)
    feed = {"x": rng.normal(size=(8, K)).astype(np.float32)}
    smoothed, report = _smooth_and_compare(model, feed, nodes={"mm"})
    (group,) = report.groups
    assert group.nodes == ("mm",) and group.folded_into == ""
    mul = next(n for n in smoothed.graph.node if n.op_type == "Mul")
    by_name = {n.name: n for n in smoothed.graph.node}
    assert by_name["mm"].input[0] == mul.output[0]
    assert list(by_name["mm_float"].input) == ["t", "w"] and by_name["relu"].input[0] == "t"
    want, got = _run(model, feed), _run(smoothed, feed)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


def test_a_shape_reader_does_not_prevent_folding():
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma"], ["t"], name="ln"),
        helper.make_node("MatMul", ["t", "w"], ["out"], name="mm"),
        helper.make_node("Shape", ["t"], ["shape"], name="shape"),
    ]
    inits = {"gamma": _outlier_gamma(rng), "w": rng.normal(size=(K, 8))}
    model = _model(nodes, {"x": [8, K]}, ["out", "shape"], inits)
    _, report = _smooth_and_compare(model, {"x": rng.normal(size=(8, K)).astype(np.float32)})
    assert report.groups[0].folded_into == "ln"


def test_chained_matmuls_each_rescale_the_weight_the_previous_group_left():
    rng = np.random.default_rng(5)
    inits, nodes, previous = {}, [], "x"
    for i in range(3):
        w = rng.normal(size=(K, K))
        w[:, OUTLIERS] *= 20.0
        inits[f"w{i}"] = w
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        previous = f"y{i}"
    model = _model(nodes, {"x": [32, K]}, ["y2"], inits)
    _, report = _smooth_and_compare(model, {"x": _outlier_input(rng, (32, K))})
    assert [g.tensor for g in report.groups] == ["x", "y0", "y1"]
    assert [g.folded_into for g in report.groups] == ["", "mm0", "mm1"]


def test_detached_weights_get_new_detached_copies_and_the_inputs_stay_untouched():
    rng = np.random.default_rng(6)
    big = 128  # 128 x 128 float32 = 64 KiB: detached
    gamma = rng.uniform(0.5, 1.5, big)
    gamma[OUTLIERS] *= 40.0
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma"], ["t"], name="ln"),
        helper.make_node("MatMul", ["t", "w"], ["out"], name="mm"),
    ]
    model = _model(nodes, {"x": [4, big]}, ["out"], {"gamma": gamma, "w": rng.normal(size=(big, big))})
    store = Weights()
    assert store.detach(model.graph) == 1
    before, arrays = model.SerializeToString(), {k: v.copy() for k, v in store.arrays.items()}
    smoothed, report = _smooth_and_compare(model, {"x": rng.normal(size=(4, big)).astype(np.float32)}, store=store)
    assert report.groups[0].folded_into == "ln"
    assert model.SerializeToString() == before
    for name, values in arrays.items():
        np.testing.assert_array_equal(store.arrays[name], values)
    weight = next(i for i in smoothed.graph.initializer if i.name.startswith("w/"))
    assert is_detached(weight) and weight.name in store.arrays


def test_outliers_moved_into_the_weights_raise_the_quantized_sqnr():
    rng = np.random.default_rng(7)
    x = _outlier_input(rng, (1024, 64), factor=100.0)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    model = _matmul([1024, 64], w)
    smoothed, report = smooth(model, Weights(), {"x": channel_absmax(x)}, {"mm"}, alpha=0.5)
    assert report.groups[0].folded_into == ""
    inits = {i.name: numpy_helper.to_array(i) for i in smoothed.graph.initializer}
    mul, mm = smoothed.graph.node
    x_smooth, w_smooth = x * inits[mul.input[1]], inits[mm.input[1]]

    def quantized_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        qa = compute_qparams(a.min(), a.max(), UINT8, symmetric=False)
        lo, hi = weight_range(b, axis=1)
        qb = compute_qparams(lo, hi, INT8, symmetric=True, narrow_range=True, axis=1)
        return dequantize(quantize(a, qa), qa).astype(np.float64) @ dequantize(quantize(b, qb), qb)

    reference = x.astype(np.float64) @ w

    def sqnr(product: np.ndarray) -> float:
        return float(10 * np.log10(np.sum(reference**2) / np.sum((product - reference) ** 2)))

    before, after = sqnr(quantized_product(x, w)), sqnr(quantized_product(x_smooth, w_smooth))
    assert after >= before + 6.0, (before, after)


def test_a_tensor_without_outliers_is_skipped_and_the_model_unchanged():
    rng = np.random.default_rng(8)
    model = _matmul([64, K], rng.normal(size=(K, 4)))
    stats = {"x": channel_absmax(rng.normal(size=(64, K)))}
    smoothed, report = smooth(model, Weights(), stats, {"mm"}, alpha=0.5)
    assert report.groups == () and report.skipped[0][0] == "x" and "outlier ratio" in report.skipped[0][1]
    assert smoothed.SerializeToString() == model.SerializeToString()
    _, forced = smooth(model, Weights(), stats, {"mm"}, alpha=0.5, min_outlier_ratio=0.0)
    assert len(forced.groups) == 1


def test_smoothing_is_deterministic():
    rng = np.random.default_rng(9)
    model = _qkv(rng)
    stats = _absmax(model, {"x": rng.normal(size=(4, 6, K)).astype(np.float32)})
    first, first_report = smooth(model, Weights(), stats, lambda name: "matmul" in name, alpha=lambda _n: 0.6)
    second, second_report = smooth(model, Weights(), stats, lambda name: "matmul" in name, alpha=lambda _n: 0.6)
    assert first.SerializeToString() == second.SerializeToString() and first_report == second_report
    assert first_report.groups[0].alpha == 0.6


def test_unsmoothable_readers_and_missing_statistics_are_reported():
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Gemm", ["a", "w"], ["y1"], name="gemm_ta", transA=1),
        helper.make_node("MatMul", ["x", "b"], ["y2"], name="two_activations"),
        helper.make_node("MatMul", ["x", "w"], ["y3"], name="no_stats"),
    ]
    model = _model(nodes, {"a": [K, 4], "x": [4, K], "b": [K, 4]}, ["y1", "y2", "y3"], {"w": rng.normal(size=(K, 4))})
    _, report = smooth(model, Weights(), {"a": np.ones(K)}, {"gemm_ta", "two_activations"} | {"no_stats"}, alpha=0.5)
    reasons = dict(report.skipped)
    assert "transA=1" in reasons["a"]
    assert report.skipped[1] == ("x", "node 'two_activations': input B is not a constant initializer")
    assert report.skipped[2] == ("x", "no activation statistics")


def test_scales_are_guarded():
    s = smoothing_scales(np.array([4.0, 0.0, np.inf, 1e12, 1.0]), np.array([1.0, 2.0, 1.0, 1e-12, 0.0]), 0.5)
    assert s.dtype == np.float32
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0, 1e5, 1.0])
    np.testing.assert_allclose(smoothing_scales(np.array([8.0]), np.array([2.0]), 1.0), [8.0])
    with pytest.raises(QtoolError, match="alpha"):
        smoothing_scales(np.ones(2), np.ones(2), 1.5)
    with pytest.raises(QtoolError, match="does not match"):
        smoothing_scales(np.ones(2), np.ones(3), 0.5)


def test_channel_absmax_merges_by_maximum_and_outlier_ratio():
    rng = np.random.default_rng(11)
    a, b = rng.normal(size=(3, 5, 4)), rng.normal(size=(7, 4))
    merged = np.maximum(channel_absmax(a), channel_absmax(b))
    np.testing.assert_allclose(merged, np.abs(np.concatenate([a.reshape(-1, 4), b])).max(axis=0), rtol=1e-6)
    assert outlier_ratio(np.array([1.0, 1.0, 1.0, 10.0])) == 10.0
    assert outlier_ratio(np.zeros(3)) == 0.0 and outlier_ratio(np.array([0.0, 0.0, 2.0])) == float("inf")


def test_a_bad_alpha_is_refused():
    model = _matmul([4, K], np.ones((K, 2)))
    with pytest.raises(QtoolError, match="outside"):
        smooth(model, Weights(), {"x": np.arange(1.0, K + 1) ** 3}, {"mm"}, alpha=-0.1)


def test_sample_transformer_keeps_its_outputs_with_every_matmul_smoothed():
    model = onnx.load(sample("transformer"))
    feeds = sorted(calib_dir("transformer").glob("*.npy"))[:4]
    name = model.graph.input[0].name
    feed = {name: np.stack([np.load(f) for f in feeds]).astype(np.float32)}
    _, report = _smooth_and_compare(model, feed, min_outlier_ratio=0.0)
    folded = {g.tensor: g.folded_into for g in report.groups}
    assert folded["ln1_out"] == "ln1" and folded["ln2_out"] == "ln2"
    assert folded["gelu_out"] == "ffn/gelu/half"  # a Mul by a scalar constant takes a per-channel one


@pytest.mark.parametrize("shared", [False, True])
def test_a_decomposed_layernorm_affine_absorbs_the_scale_unless_its_product_is_read_elsewhere(shared):
    rng = np.random.default_rng(12)
    nodes = [
        helper.make_node("Mul", ["z", "gamma"], ["scaled"], name="affine/mul"),
        helper.make_node("Add", ["beta", "scaled"], ["t"], name="affine/add"),
        helper.make_node("MatMul", ["t", "w"], ["out"], name="mm"),
    ]
    outputs = ["out"]
    if shared:
        nodes.append(helper.make_node("Relu", ["scaled"], ["r"], name="relu"))
        outputs.append("r")
    inits = {"gamma": _outlier_gamma(rng)[None], "beta": np.float32(0.3), "w": rng.normal(size=(K, 4))}
    model = _model(nodes, {"z": [8, K]}, outputs, inits)
    smoothed, report = _smooth_and_compare(model, {"z": rng.normal(size=(8, K)).astype(np.float32)}, nodes={"mm"})
    assert report.groups[0].folded_chain == (() if shared else ("affine/add", "affine/mul"))
    assert _ops(smoothed)["Mul"] == (2 if shared else 1)


def test_a_bias_that_broadcasts_a_single_channel_is_not_folded_through():
    rng = np.random.default_rng(13)
    nodes = [
        helper.make_node("Mul", ["z", "two"], ["y"], name="mul"),  # y is [8, 1]
        helper.make_node("Add", ["y", "c"], ["t"], name="add"),  # t is [8, K]
        helper.make_node("MatMul", ["t", "w"], ["out"], name="mm"),
    ]
    c = rng.normal(size=K)
    c[OUTLIERS] *= 50.0
    model = _model(nodes, {"z": [8, 1]}, ["out"], {"two": np.float32(2.0), "c": c, "w": rng.normal(size=(K, 4))})
    _, report = _smooth_and_compare(model, {"z": rng.normal(size=(8, 1)).astype(np.float32)}, nodes={"mm"})
    assert report.groups[0].folded_into == ""


def test_a_tensor_read_inside_a_subgraph_is_not_folded():
    rng = np.random.default_rng(14)

    def branch(name: str, op: str) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)
        return helper.make_graph([helper.make_node(op, ["t"], [f"{name}_out"])], name, [], [out])

    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma"], ["t"], name="ln"),
        helper.make_node("MatMul", ["t", "w"], ["out"], name="mm"),
        helper.make_node(
            "If", ["cond"], ["branch"], name="if", then_branch=branch("then", "Relu"), else_branch=branch("else", "Neg")
        ),
    ]
    inits = {"gamma": _outlier_gamma(rng), "w": rng.normal(size=(K, 4))}
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, K]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "branch")],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    feed = {"x": rng.normal(size=(8, K)).astype(np.float32), "cond": np.array(True)}
    smoothed, report = _smooth_and_compare(model, feed, nodes={"mm"})
    assert report.groups[0].folded_into == ""
    np.testing.assert_array_equal(_run(smoothed, feed)[1], _run(model, feed)[1])
