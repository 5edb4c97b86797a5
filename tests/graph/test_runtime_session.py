"""The provider-fallback notice of onnxruntime stays off stdout; its errors read without C++ signatures; sessions
over detached values still fold what only constant folding can run."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.session import create_session, inference_session, runtime_message
from qtool.graph.weights import Weights
from tests.conftest import run_model, sample

# What onnxruntime-gpu 1.31.1 raised on an H200 without TensorRT's libraries (2026-11-26).
TENSORRT_ERROR = (
    "/onnxruntime_src/onnxruntime/python/onnxruntime_pybind_state.cc:729 void onnxruntime::python::"
    "RegisterTensorRTPluginsAsCustomOps(PySessionOptions&, const onnxruntime::ProviderOptions&) Please install "
    "TensorRT libraries as mentioned in the GPU requirements page, make sure they're in the PATH or "
    "LD_LIBRARY_PATH, and that your GPU is supported."
)


def test_a_session_that_fails_raises_without_printing_a_fallback_notice(capsys):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op_thread_affinities", "first")  # onnxruntime would fall back
    with pytest.raises(Exception, match="Processor id must consist of only digits") as caught:
        inference_session(str(sample("cnn")), options)
    assert capsys.readouterr().out == ""
    assert runtime_message(str(caught.value)).startswith("std::all_of(")  # no source location, no signature


def test_a_provider_that_cannot_start_is_named_in_its_own_words():
    assert runtime_message(TENSORRT_ERROR).startswith("Please install TensorRT libraries")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain words", "plain words"),
        ("/src/a.cc:12 void f(int (*)(int), g<h>) the message", "the message"),
        ("/src/a.cc:12 unbalanced (signature", "/src/a.cc:12 unbalanced (signature"),
        ("[ONNXRuntimeError] : 1 : FAIL : Load model failed", "[ONNXRuntimeError] : 1 : FAIL : Load model failed"),
    ],
)
def test_runtime_messages_lose_only_a_leading_source_location_and_signature(text, expected):
    assert runtime_message(text) == expected


def _position_embedding_model() -> onnx.ModelProto:
    """As DINOv2 exports resize their position embeddings: a cubic Resize of a reshaped constant table whose grid
    side is computed (Pow -> Cast); onnxruntime's kernel refuses it at run time, its constant folding computes it."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((1, 1369, 64)).astype(np.float32), "pos"),  # detached: 350 KB
        numpy_helper.from_array(np.array(1369.0, np.float32), "n"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([64], np.int64), "channels"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([1, 64, 16, 16], np.int64), "sizes"),
    ]
    nodes = [
        helper.make_node("Pow", ["n", "half"], ["side_f"]),
        helper.make_node("Cast", ["side_f"], ["side"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["side", "axis0"], ["side_1d"]),
        helper.make_node("Concat", ["one", "side_1d", "side_1d", "channels"], ["grid_shape"], axis=0),
        helper.make_node("Reshape", ["pos", "grid_shape"], ["grid"]),
        helper.make_node("Transpose", ["grid"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Resize", ["nchw", "", "", "sizes"], ["small"], mode="cubic"),
        helper.make_node("Add", ["x", "small"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "position_embedding",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 16, 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_constant_computation_on_a_detached_value_runs_with_constant_folding():
    model = _position_embedding_model()
    expected = run_model(model.SerializeToString(), {"x": np.zeros((1, 64, 16, 16), np.float32)})[0]
    weights = Weights()
    assert weights.detach(model.graph) == 1  # the table's values live in the store, as prepare leaves them
    session = create_session(model, "the model", weights=weights)
    got = session.run(None, {"x": np.zeros((1, 64, 16, 16), np.float32)})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_tied_embeddings_transpose_keeps_sharing_the_weights():
    # an output projection reading the embedding table through a Transpose runs the same unfolded: no copies of
    # a large model's weights for it, while the cubic Resize of a position table needs folding
    from qtool.graph.session import _folds_detached

    rng = np.random.default_rng(1)
    table = numpy_helper.from_array(rng.standard_normal((4096, 64)).astype(np.float32), "embed")  # 1 MiB: detached
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embed", "ids"], ["h"]),
            helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
            helper.make_node("MatMul", ["h", "embed_t"], ["logits"]),
        ],
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 8, 4096])],
        [table],
    )
    tied = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    position = _position_embedding_model()
    for model in (tied, position):
        assert Weights().detach(model.graph) == 1
    assert not _folds_detached(tied) and _folds_detached(position)
