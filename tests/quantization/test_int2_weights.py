"""2-bit block-wise MatMul weights: written so that onnxruntime computes them right and the same every session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool

INT2 = (
    "global: {weight_only: true, weight: {dtype: int2, granularity: per_block, block_size: 32, "
    "final_layer_int8: false}}\naccuracy: {target_sqnr_db: null}\n"
)
K = 128


def _matmul(path: Path, n: int, op: str = "MatMul") -> Path:
    """x [2, K] @ W: one weighted node (MatMul, Gemm, or Gemm reading W transposed) with ``n`` output columns."""
    transposed = op == "Gemm transB"
    weight = np.random.default_rng(n).normal(size=(n, K) if transposed else (K, n)).astype(np.float32)
    node = helper.make_node(op.split()[0], ["x", "w"], ["y"], name="proj", **({"transB": 1} if transposed else {}))
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, path)
    return path


def _run(path: Path, x: np.ndarray, optimized: bool = True) -> np.ndarray:
    """The output of a fresh onnxruntime session: optimized as a user gets it, or each node as written."""
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize(
    "op, columns, form",
    [
        ("MatMul", 10, "MatMulNBits"),
        ("MatMul", 12, "DequantizeLinear"),
        ("Gemm", 10, "MatMulNBits"),  # a Gemm reading [K, N] is fused the same way
        ("Gemm transB", 10, "DequantizeLinear"),  # an [N, K] weight is not: it stays as written
    ],
)
def test_int2_weights_compute_the_dequantized_product_in_every_session(tmp_path, op, columns, form):
    model = _matmul(tmp_path / "model.onnx", columns, op)
    config = tmp_path / "int2.yaml"
    config.write_text(INT2)
    out = tmp_path / "int2.onnx"
    qtool.quantize(model, out, config_path=config, search=None, evaluation=None)
    assert form in [n.op_type for n in onnx.load(out).graph.node]
    (row,) = qtool.inspect(model, config_path=config).rows
    # onnxruntime's own fusion of the QDQ form corrupts the columns that split bytes: inspect says why
    assert ("not a multiple of 4" in row.placement_reason) == (form == "MatMulNBits")
    assert row.predicted_kernel == ("float Gemm" if op == "Gemm transB" else "MatMulNBits")
    x = np.random.default_rng(1).normal(size=(2, K)).astype(np.float32)
    as_written = _run(out, x, optimized=False)  # the weight dequantized exactly as stored, then multiplied
    outputs = [_run(out, x) for _ in range(4)]
    for y in outputs:
        np.testing.assert_array_equal(y, outputs[0])
    # the same product (onnxruntime's MatMulNBits may round the input to int8), not a corrupted repack's garbage
    assert np.abs(outputs[0] - as_written).max() < 0.02 * np.abs(as_written).max()
