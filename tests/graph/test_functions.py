"""Model-local functions (onnxscript, torch's exporter with modules as functions) are inlined before planning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import qtool
from tests.conftest import run_model


def _two_layers_as_functions(path: Path) -> Path:
    """Two Linear+ReLU layers, each a call of one model-local function whose weight is an input of the call."""
    rng = np.random.default_rng(0)
    body = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    function = helper.make_function(
        "custom.local", "LinearRelu", ["x", "w", "b"], ["y"], body, [helper.make_opsetid("", 18)]
    )
    inits = [
        numpy_helper.from_array((rng.standard_normal((64, 128)) * 0.1).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(128, np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((128, 64)) * 0.1).astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(64, np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("LinearRelu", ["input", "w1", "b1"], ["h"], domain="custom.local", name="l1"),
        helper.make_node("LinearRelu", ["h", "w2", "b2"], ["out"], domain="custom.local", name="l2"),
    ]
    graph = helper.make_graph(
        nodes,
        "functions",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 64])],
        inits,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("custom.local", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_weights_read_inside_local_functions_are_quantized(tmp_path: Path) -> None:
    model = _two_layers_as_functions(tmp_path / "f.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(16):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 64)).astype(np.float32))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, evaluation=None)
    # before: both calls passed through whole, 1.00x
    assert result.prepare.inlined_functions == ["custom.local:LinearRelu"]
    assert sorted(result.rewrite.quantized_weights) == ["w1", "w2"] and result.compression_ratio > 3
    written = onnx.load(out)
    assert not written.functions and "MatMul" in {n.op_type for n in written.graph.node}
    assert sum(i.data_type == TensorProto.INT8 for i in written.graph.initializer) == 2
    x = rng.standard_normal((1, 64)).astype(np.float32)
    reference, quantized = run_model(model, {"input": x})[0], run_model(out, {"input": x})[0]
    assert 10 * np.log10(np.sum(reference**2) / np.sum((reference - quantized) ** 2)) > 30
