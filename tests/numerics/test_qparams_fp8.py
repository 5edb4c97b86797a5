"""float8 qparams: scale = amax / max, zero point 0 of the fp8 type, values rounded to the fp8 grid.

QuantizeLinear numerics are checked against onnx's ReferenceEvaluator and onnxruntime's CPU kernels.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool.errors import QtoolError
from qtool.numerics.qparams import (
    QUANT_TYPES,
    compute_qparams,
    dequantize,
    quantize,
    to_tensor_proto,
    weight_range,
)

E4M3, E5M2 = QUANT_TYPES["fp8_e4m3"], QUANT_TYPES["fp8_e5m2"]
MANTISSA_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}


def _quantize_model(qp, *, as_float=False):
    """QuantizeLinear of input x with ``qp``'s scale and zero point as initializers (then a Cast to float).

    onnxruntime hands no float8 tensor to numpy; the Cast to float32 is exact.
    """
    kwargs = {"axis": qp.axis} if qp.axis is not None else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q" if as_float else "y"], **kwargs)]
    if as_float:
        nodes.append(helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(
        nodes,
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT if as_float else qp.qtype.onnx_type, None)],
        [numpy_helper.from_array(np.asarray(qp.scale), "s"), numpy_helper.from_array(np.asarray(qp.zero_point), "z")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _reference(x, qp):
    return ReferenceEvaluator(_quantize_model(qp)).run(None, {"x": x})[0]


def _onnxruntime(x, qp):
    model = _quantize_model(qp, as_float=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values).view(np.uint8)


@pytest.mark.parametrize(("qtype", "largest"), [(E4M3, 448.0), (E5M2, 57344.0)])
def test_scale_is_amax_over_the_largest_fp8_value_and_the_zero_point_an_fp8_zero(qtype, largest):
    qp = compute_qparams(-3.0, 2.0, qtype, symmetric=True, narrow_range=True)
    assert qp.scale == pytest.approx(3.0 / largest) and qp.scale.dtype == np.float32
    assert qp.zero_point.dtype == qtype.numpy_dtype and float(qp.zero_point) == 0.0
    assert not qp.narrow and qp.qmin == -largest
    assert qtype.bits == 8 and qtype.signed
    q = quantize(np.array([-3.0, 3.0, 0.0, 1e9, -np.inf], np.float32), qp)
    assert q.dtype == qtype.numpy_dtype
    assert q.astype(np.float32).tolist() == [-largest, largest, 0.0, largest, -largest]  # saturated, not NaN/inf


def test_asymmetric_fp8_is_refused_naming_the_tensor():
    with pytest.raises(QtoolError, match="conv_out: fp8_e4m3 is quantized symmetrically only"):
        compute_qparams(-1.0, 3.0, E4M3, symmetric=False, what="conv_out")


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=64),
    qtype=st.sampled_from([E4M3, E5M2]),
)
def test_quantize_matches_the_reference_and_onnxruntime_and_the_error_is_half_an_fp8_step(data, qtype):
    x = np.asarray(data, np.float32)
    qp = compute_qparams(x.min(), x.max(), qtype, symmetric=True)
    q = quantize(x, qp)
    np.testing.assert_array_equal(_bits(q), _bits(_reference(x, qp)))
    np.testing.assert_array_equal(q.astype(np.float32), _onnxruntime(x, qp))
    # round to nearest: within half a step of the fp8 grid, relative above the subnormals
    info = ml_dtypes.finfo(qtype.numpy_dtype)
    relative = 2.0 ** -(MANTISSA_BITS[qtype.name] + 1)
    bound = np.maximum(np.abs(x) * relative, float(info.smallest_subnormal) / 2 * float(qp.scale))
    assert np.all(np.abs(dequantize(q, qp) - x) <= bound * (1 + 1e-5) + 1e-12)


def test_per_channel_fp8_matches_the_reference_along_the_output_axis():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (4, 3, 2, 2)).astype(np.float32) * np.array([1, 10, 0.1, 0], np.float32)[:, None, None, None]
    lo, hi = weight_range(w, 0)
    qp = compute_qparams(lo, hi, E4M3, symmetric=True, narrow_range=True, axis=0)
    assert qp.scale.shape == (4,) and qp.scale[3] == 1.0  # an all-zero channel keeps a usable scale
    q = quantize(w, qp)
    np.testing.assert_array_equal(_bits(q), _bits(_reference(w, qp)))
    peaks = np.abs(q.astype(np.float32)).reshape(4, -1).max(axis=1)
    assert peaks[:3].tolist() == [448.0] * 3  # every channel reaches the fp8 maximum


def test_fp8_initializers_hold_one_byte_per_value_and_read_back():
    qp = compute_qparams(-1.0, 1.0, E4M3, symmetric=True)
    values = quantize(np.linspace(-1, 1, 10, dtype=np.float32), qp)
    tensor = to_tensor_proto(values, E4M3, "w")
    assert tensor.data_type == TensorProto.FLOAT8E4M3FN
    assert len(tensor.raw_data) == 10
    np.testing.assert_array_equal(_bits(numpy_helper.to_array(tensor)), _bits(values))
