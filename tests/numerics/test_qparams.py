from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from qtool.numerics.qparams import (
    QUANT_TYPES,
    compute_qparams,
    dequantize,
    quantize,
    quantize_bias,
    weight_range,
    within_ceiling,
)

INT8, UINT8 = QUANT_TYPES["int8"], QUANT_TYPES["uint8"]


def test_symmetric_int8_uses_absmax_over_127_and_zero_point_zero():
    qp = compute_qparams(-2.0, 1.0, INT8, symmetric=True, narrow_range=True)
    assert qp.scale == pytest.approx(2.0 / 127)
    assert qp.zero_point == 0
    q = quantize(np.array([-2.0, 2.0, 0.0], np.float32), qp)
    assert q.tolist() == [-127, 127, 0]


def test_asymmetric_uint8_covers_the_range_and_represents_zero_exactly():
    qp = compute_qparams(-1.0, 3.0, UINT8, symmetric=False)
    assert qp.scale == pytest.approx(4.0 / 255, rel=1e-6)
    zero = quantize(np.zeros(1, np.float32), qp)
    assert dequantize(zero, qp)[0] == 0.0
    assert quantize(np.array([-1.0, 3.0], np.float32), qp).tolist() == [0, 255]


def test_a_clip_outputs_grid_is_kept_within_the_clip_as_onnxruntime_checks_it():
    """onnxruntime drops a Clip before a quantizer only if ``scale * 255`` (float32) passes its bound by <= epsilon."""
    ceiling = np.float32(7.9813337326049805)  # float32(c / 255) * 255 rounds up past c: one such c in 700
    qp = compute_qparams(0.0, float(ceiling), UINT8, symmetric=False)
    assert np.float32(qp.scale * np.float32(255)) > ceiling + np.finfo(np.float32).eps  # without the ceiling: kept
    kept = within_ceiling(qp, float(ceiling))
    assert np.float32(kept.scale * np.float32(255)) <= ceiling + np.finfo(np.float32).eps
    assert kept.zero_point == 0 and float(kept.scale) == pytest.approx(float(qp.scale), rel=1e-6)  # an ulp or two
    six = compute_qparams(0.0, 6.0, UINT8, symmetric=False)
    assert within_ceiling(six, 6.0) is six  # float32(6 / 255) * 255 is 6: nothing to lower


def test_range_is_widened_to_include_zero():
    qp = compute_qparams(2.0, 5.0, UINT8, symmetric=False)  # all positive: range becomes [0, 5]
    assert qp.zero_point == 0
    assert dequantize(quantize(np.zeros(1, np.float32), qp), qp)[0] == 0.0


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("qtype", [INT8, UINT8])
def test_all_zero_and_constant_tensors_give_finite_nonzero_scales(symmetric, qtype):
    for lo, hi in [(0.0, 0.0), (3.5, 3.5), (-1e-30, -1e-30)]:
        qp = compute_qparams(lo, hi, qtype, symmetric=symmetric)
        assert np.all(np.isfinite(qp.scale)) and np.all(qp.scale > 0)
    qp = compute_qparams(3.5, 3.5, qtype, symmetric=symmetric)
    restored = dequantize(quantize(np.full(4, 3.5, np.float32), qp), qp)
    np.testing.assert_allclose(restored, 3.5, atol=float(qp.scale) / 2 + 1e-7)


def test_non_finite_range_is_a_user_error_naming_the_tensor():
    from qtool.errors import QtoolError

    with pytest.raises(QtoolError, match="conv_out"):
        compute_qparams(-np.inf, 1.0, UINT8, symmetric=False, what="tensor conv_out")


def test_per_channel_weight_range_along_axis():
    w = np.zeros((3, 2, 2), np.float32)
    w[0], w[1], w[2] = 1.0, -4.0, 2.0
    lo, hi = weight_range(w, 0)
    assert lo.tolist() == [1.0, -4.0, 2.0] and hi.tolist() == [1.0, -4.0, 2.0]
    w[1, 0, 0] = 5.0
    lo, hi = weight_range(w.transpose(1, 2, 0), 2)
    assert lo.tolist() == [1.0, -4.0, 2.0] and hi.tolist() == [1.0, 5.0, 2.0]


def test_bias_scale_is_input_scale_times_weight_scale_per_channel():
    w_scale = np.array([0.1, 0.2], np.float32)
    q, qp = quantize_bias(np.array([1.0, -1.0], np.float32), np.float32(0.5), w_scale)
    np.testing.assert_allclose(qp.scale, [0.05, 0.1])
    assert q.dtype == np.int32 and q.tolist() == [20, -10] and qp.axis == 0


def _reference_quantize(x, scale, zero, axis=None):
    kwargs = {"axis": axis} if axis is not None else {}
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **kwargs)
    zt = TensorProto.INT8 if zero.dtype == np.int8 else TensorProto.UINT8
    graph = helper.make_graph(
        [node],
        "q",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", zt, None),
        ],
        [helper.make_tensor_value_info("y", zt, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return ReferenceEvaluator(model).run(None, {"x": x, "s": scale, "z": zero})[0]


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=64),
    symmetric=st.booleans(),
    qtype=st.sampled_from([INT8, UINT8]),
)
def test_quantize_matches_onnx_reference_and_round_trip_error_is_half_a_step(data, symmetric, qtype):
    x = np.asarray(data, np.float32)
    qp = compute_qparams(x.min(), x.max(), qtype, symmetric=symmetric)
    q = quantize(x, qp)
    np.testing.assert_array_equal(q, _reference_quantize(x, qp.scale, qp.zero_point))
    err = np.abs(dequantize(q, qp) - x)
    assert np.all(err <= float(qp.scale) / 2 * (1 + 1e-5) + 1e-7)


def test_per_channel_quantize_matches_onnx_reference():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (4, 3, 2, 2)).astype(np.float32) * np.array([1, 10, 0.1, 0], np.float32)[:, None, None, None]
    lo, hi = weight_range(w, 0)
    qp = compute_qparams(lo, hi, INT8, symmetric=True, narrow_range=True, axis=0)
    np.testing.assert_array_equal(quantize(w, qp), _reference_quantize(w, qp.scale, qp.zero_point, axis=0))
    err = np.abs(dequantize(quantize(w, qp), qp) - w)
    assert np.all(err <= qp.scale[:, None, None, None] / 2 + 1e-7)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_symmetric_narrow_range_never_uses_the_most_negative_code(name):
    qtype = QUANT_TYPES[name]
    qp = compute_qparams(-1.0, 1.0, qtype, symmetric=True, narrow_range=True)
    q = quantize(np.linspace(-3, 3, 101, dtype=np.float32), qp)
    assert q.min() == -qtype.qmax and q.max() == qtype.qmax
