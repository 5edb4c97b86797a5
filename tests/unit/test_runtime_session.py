"""The provider-fallback notice of onnxruntime stays off stdout; its errors read without C++ signatures."""

from __future__ import annotations

import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qtool.graph.session import _ep_error, inference_session, runtime_message

# What onnxruntime-gpu 1.31.1 printed to stdout on an H200 without TensorRT's libraries (2026-11-26).
TENSORRT_NOTICE = """*************** EP Error ***************
EP Error /onnxruntime_src/onnxruntime/python/onnxruntime_pybind_state.cc:729 void onnxruntime::python::\
RegisterTensorRTPluginsAsCustomOps(PySessionOptions&, const onnxruntime::ProviderOptions&) Please install TensorRT \
libraries as mentioned in the GPU requirements page, make sure they're in the PATH or LD_LIBRARY_PATH, and that \
your GPU is supported.
 when using ['TensorrtExecutionProvider', 'CUDAExecutionProvider', 'CPUExecutionProvider']
Falling back to ['CUDAExecutionProvider', 'CPUExecutionProvider'] and retrying.
****************************************
"""


def _relu() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def test_the_fallback_notice_onnxruntime_prints_never_reaches_stdout(capsys):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op_thread_affinities", "first")  # fails: onnxruntime falls back
    with pytest.raises(Exception, match="Processor id must consist of only digits") as caught:
        inference_session(_relu(), options)
    assert capsys.readouterr().out == ""
    assert runtime_message(str(caught.value)).startswith("std::all_of(")  # no source location, no signature


def test_the_fallback_error_is_the_providers_own_words():
    assert _ep_error(TENSORRT_NOTICE) == (
        "Please install TensorRT libraries as mentioned in the GPU requirements page, make sure they're in the "
        "PATH or LD_LIBRARY_PATH, and that your GPU is supported."
    )


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
