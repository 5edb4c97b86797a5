"""The Q/DQ rewrite: what the plan says is inserted, the model runs in onnxruntime close to float."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.quantization.emit.rewrite import insert_qdq
from qtool.quantization.plan.activations import activation_qparams
from qtool.quantization.plan.planner import build_plan
from tests.quantization.models import conv_chain, prepared


def _ranges(model: onnx.ModelProto, x: np.ndarray, names: list[str]) -> dict[str, tuple[float, float]]:
    """Each tensor's min and max on ``x``, from the float model."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n != "y")
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}), strict=True))
    return {n: (float(values[n].min()), float(values[n].max())) for n in names}


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _sqnr(reference: np.ndarray, candidate: np.ndarray) -> float:
    return float(10 * np.log10((reference**2).sum() / ((reference - candidate) ** 2).sum()))


def test_integer_nodes_get_qdq_on_inputs_and_weights_and_stay_close_to_float():
    float_model = conv_chain()
    model, weights = prepared(float_model)
    plan = build_plan(model, load_config({"global": {"placement": "integer"}}))
    x = np.random.default_rng(1).normal(size=(1, 3, 32, 32)).astype(np.float32)
    ranges = _ranges(weights.embedded(model), x, list(plan.activations))
    qparams = {
        t: activation_qparams(np.asarray(lo), np.asarray(hi), scheme, t)
        for (t, scheme), (lo, hi) in zip(plan.activations.items(), ranges.values(), strict=True)
    }
    quantized, report = insert_qdq(model, plan, qparams, weights)
    ops = [n.op_type for n in quantized.graph.node]
    assert ops.count("QuantizeLinear") == len(plan.activations)
    assert report.quantized_nodes == ["conv0", "conv1", "conv2"] and set(report.quantized_biases) == {"b0", "b1", "b2"}
    assert _sqnr(_run(float_model, x), _run(weights.embedded(quantized), x)) > 25


def test_an_activation_without_statistics_is_refused():
    model, weights = prepared(conv_chain())
    plan = build_plan(model, load_config({"global": {"placement": "integer"}}))
    with pytest.raises(QtoolError, match="no statistics for tensor 'x'"):
        insert_qdq(model, plan, {}, weights)


def test_the_input_model_is_left_as_it_was():
    model, weights = prepared(conv_chain())
    before = model.SerializeToString()
    plan = build_plan(model, load_config({"global": {"weight_only": True}}))
    insert_qdq(model, plan, {}, weights)
    assert model.SerializeToString() == before
