"""The provider-fallback notice of onnxruntime stays off stdout; its errors read without C++ signatures."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from qtool.graph.session import inference_session, runtime_message
from tests.conftest import sample

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
