"""Stored forms of quantized weights, checked with onnx's reference evaluator as an independent oracle."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from qtool.numerics.qparams import (
    QUANT_TYPES,
    QParams,
    compute_qparams,
    dequantize,
    quantize,
    weight_range,
)
from qtool.quantization.emit.stored_forms import Names, StoredForms


def _evaluate(forms: StoredForms, prologue: list[onnx.NodeProto], output: str, opset: int = 21) -> np.ndarray:
    graph = forms.graph
    graph.node.extend(prologue)
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, None))
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", opset)])
    return ReferenceEvaluator(model).run(None, {})[0]


def _forms() -> tuple[StoredForms, list[onnx.NodeProto]]:
    graph = helper.make_graph([], "g", [], [])
    prologue: list[onnx.NodeProto] = []
    return StoredForms(Names(graph), graph, prologue), prologue


def _qparams(weight: np.ndarray, dtype: str, axis: int | None, block: int | None = None) -> QParams:
    lo, hi = weight_range(weight, axis, block)
    qp = compute_qparams(lo, hi, QUANT_TYPES[dtype], symmetric=True, narrow_range=True, axis=axis, what="w")
    return QParams(qp.scale, qp.zero_point, qp.qtype, axis, block, qp.narrow)


def test_a_per_channel_int4_weight_is_widened_and_dequantizes_to_its_grid():
    weight = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    qp = _qparams(weight, "int4", axis=0)
    forms, prologue = _forms()
    stored = forms.integers("w", quantize(weight, qp), qp)
    forms.dequantized("w", stored, qp, "w_float")
    assert [n.op_type for n in prologue] == ["Cast", "DequantizeLinear"]  # no int4 kernel: widened to int8 first
    np.testing.assert_allclose(_evaluate(forms, prologue, "w_float"), dequantize(quantize(weight, qp), qp), rtol=1e-6)


def test_a_symmetric_per_block_weight_keeps_its_narrow_type_and_stores_no_zero_point():
    weight = np.random.default_rng(1).normal(size=(64, 4)).astype(np.float32)
    qp = _qparams(weight, "int4", axis=0, block=32)
    forms, prologue = _forms()
    stored = forms.integers("w", quantize(weight, qp), qp)
    forms.dequantized("w", stored, qp, "w_float", zero_point=False)
    (dq,) = prologue
    assert dq.op_type == "DequantizeLinear" and len(dq.input) == 2  # the all-zero zero point is left out
    packed = next(t for t in forms.graph.initializer if t.name == stored)
    assert packed.data_type == TensorProto.INT4 and len(packed.raw_data) == weight.size // 2
    np.testing.assert_allclose(_evaluate(forms, prologue, "w_float"), dequantize(quantize(weight, qp), qp), rtol=1e-6)


def test_names_never_clash_with_the_graphs():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["w/quantized"], name="n")], "g", [], [])
    names = Names(graph)
    assert names.new("w/quantized") == "w/quantized_2" and names.new("w/quantized") == "w/quantized_3"
