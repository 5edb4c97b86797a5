from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.prepare import prepare_model
from qtool.graph.weights import Weights


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def _einsum_model(equation: str, x_shape: list[int], w: np.ndarray, weight_first: bool = False) -> onnx.ModelProto:
    inputs = ["w", "x"] if weight_first else ["x", "w"]
    graph = helper.make_graph(
        [helper.make_node("Einsum", inputs, ["y"], name="proj", equation=equation)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    ("equation", "x_shape", "w_shape", "weight_first"),
    [
        ("bsd,dhk->bshk", [2, 5, 8], [8, 2, 4], False),  # tf2onnx's Q/K/V projection
        ("bshk,hkd->bsd", [2, 5, 2, 4], [2, 4, 8], False),  # its output projection: two contracted letters
        ("bsd,dn->bns", [2, 5, 8], [8, 6], False),  # the output in another order
        ("dn,bsd->bsn", [2, 5, 8], [8, 6], True),  # the weight first
        ("bsd,nd->bsn", [2, 5, 8], [6, 8], False),  # the weight stored transposed
        ("sbd,dhk->bhsk", [5, 2, 8], [8, 2, 4], False),  # both operands need moving
    ],
)
def test_an_einsum_with_a_constant_weight_becomes_a_matmul_with_the_same_output(
    equation, x_shape, w_shape, weight_first
):
    rng = np.random.default_rng(0)
    w = rng.normal(size=w_shape).astype(np.float32)
    model = _einsum_model(equation, x_shape, w, weight_first)
    x = rng.normal(size=x_shape).astype(np.float32)
    prepared, report = prepare_model(model)
    assert report.einsums_as_matmuls == ["proj"]
    ops = [n.op_type for n in prepared.graph.node]
    assert "Einsum" not in ops and ops.count("MatMul") == 1
    matmul = next(n for n in prepared.graph.node if n.op_type == "MatMul")
    assert matmul.name == "proj"  # config rules and reports name it as before
    weight = next(i for i in prepared.graph.initializer if i.name == matmul.input[1])
    assert len(weight.dims) == 2  # [K, N]: quantizable per output column like any MatMul weight
    np.testing.assert_allclose(
        _run(prepared, {"x": x}), np.einsum(equation, *((w, x) if weight_first else (x, w))), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "equation",
    [
        "bhqd,hdk->bhqk",  # a letter in both operands and the output: a stack of matrices, left as it is
        "bsd,dk->bs",  # a weight letter summed away
        "bii,ik->bk",  # a repeated letter
        "...d,dk->...k",  # an ellipsis
    ],
)
def test_einsums_that_are_not_plain_products_are_left_alone(equation):
    shapes = {
        "bhqd,hdk->bhqk": ([2, 3, 4, 5], [3, 5, 6]),
        "bsd,dk->bs": ([2, 3, 4], [4, 6]),
        "bii,ik->bk": ([2, 4, 4], [4, 6]),
        "...d,dk->...k": ([2, 3, 4], [4, 6]),
    }
    x_shape, w_shape = shapes[equation]
    model = _einsum_model(equation, x_shape, np.ones(w_shape, np.float32))
    prepared, report = prepare_model(model)
    assert report.einsums_as_matmuls == []
    assert [n.op_type for n in prepared.graph.node] == ["Einsum"]


def _layout_model(weight_path: list[onnx.NodeProto], inits: list[onnx.TensorProto], w_name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        [*weight_path, helper.make_node("MatMul", ["x", w_name], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_weight_behind_transpose_and_reshape_is_folded_into_one_constant():
    rng = np.random.default_rng(1)
    stored = rng.normal(size=(6, 2, 4)).astype(np.float32)  # [N, K] split in two, as an exporter might store it
    path = [
        helper.make_node("Reshape", ["w_stored", "shape"], ["w_nk"], name="reshape"),
        helper.make_node("Transpose", ["w_nk"], ["w"], name="transpose", perm=[1, 0]),
    ]
    inits = [numpy_helper.from_array(stored, "w_stored"), numpy_helper.from_array(np.array([0, -1]), "shape")]
    model = _layout_model(path, inits, "w")
    x = rng.normal(size=(3, 8)).astype(np.float32)
    prepared, report = prepare_model(model)
    assert report.folded_weight_layouts == ["reshape", "transpose"]
    assert [n.op_type for n in prepared.graph.node] == ["MatMul"]
    assert {i.name for i in prepared.graph.initializer} == {"w"}  # the stored form and the shape are dropped
    np.testing.assert_allclose(_run(prepared, {"x": x}), x @ stored.reshape(6, 8).T, rtol=1e-5, atol=1e-5)
    assert [n.op_type for n in model.graph.node] == ["Reshape", "Transpose", "MatMul"]  # the input is unchanged


def test_a_shared_weight_and_a_detached_weight_keep_their_forms():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(6, 8)).astype(np.float32)
    path = [helper.make_node("Transpose", ["w_t"], ["w"], name="transpose", perm=[1, 0])]
    shared = _layout_model(path, [numpy_helper.from_array(w, "w_t")], "w")
    shared.graph.node.append(helper.make_node("Identity", ["w_t"], ["w_copy"], name="other_reader"))
    shared.graph.output.append(helper.make_tensor_value_info("w_copy", TensorProto.FLOAT, [6, 8]))
    _, report = prepare_model(shared)
    assert report.folded_weight_layouts == []  # folding would store the weight twice

    weights = Weights()
    detached = _layout_model(path, [numpy_helper.from_array(w, "w_t")], "w")
    weights.detach(detached.graph, min_bytes=0)
    _, report = prepare_model(detached, weights)
    assert report.folded_weight_layouts == ["transpose"]
    np.testing.assert_array_equal(weights.arrays["w"], w.T)  # the folded weight stays in the store


def _tied_and_deduplicated(path) -> None:
    """A language model's shape with both ways exporters share a weight: the embedding tied to the output
    projection through a Transpose, and two equal layers written once, each use behind an Identity."""
    rng = np.random.default_rng(5)
    table = (rng.standard_normal((512, 64)) * 0.1).astype(np.float32)
    layer = (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["h0"], name="embed"),
        helper.make_node("Identity", ["layer"], ["layer_a"], name="use_a"),
        helper.make_node("MatMul", ["h0", "layer_a"], ["h1"], name="mm_a"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu_a"),
        helper.make_node("Identity", ["layer"], ["layer_b"], name="use_b"),
        helper.make_node("MatMul", ["r1", "layer_b"], ["h2"], name="mm_b"),
        helper.make_node("Transpose", ["emb"], ["emb_t"], name="tie", perm=[1, 0]),
        helper.make_node("MatMul", ["h2", "emb_t"], ["logits"], name="lm_head"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 8, 512])],
        [numpy_helper.from_array(table, "emb"), numpy_helper.from_array(layer, "layer")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def test_shared_weights_are_stored_quantized_not_kept_float_beside_a_copy(tmp_path):
    import qtool

    model, data, out = tmp_path / "tied.onnx", tmp_path / "data", tmp_path / "q.onnx"
    _tied_and_deduplicated(model)
    data.mkdir()
    rng = np.random.default_rng(6)
    for i in range(12):
        np.savez(data / f"{i}.npz", ids=rng.integers(0, 512, size=(1, 8)).astype(np.int64))
    result = qtool.quantize(model, out, data_dir=data, evaluation=None)
    # before: the Identity and Transpose of weights other nodes read stayed, so each float weight stayed in the
    # file beside its quantized copy: 0.88x
    assert {"use_a", "use_b", "tie"} <= set(result.prepare.folded_weight_layouts)
    written = onnx.load(out)
    floats = [i.name for i in written.graph.initializer if i.data_type == TensorProto.FLOAT and np.prod(i.dims) >= 4096]
    assert floats == [] and result.compression_ratio > 1.9  # the table twice 8-bit (lookup, projection), the layer once
    ids = rng.integers(0, 512, size=(1, 8)).astype(np.int64)
    reference = _run(onnx.load(model), {"ids": ids})
    quantized = _run(written, {"ids": ids})
    assert 10 * np.log10(np.sum(reference**2) / np.sum((reference - quantized) ** 2)) > 30
