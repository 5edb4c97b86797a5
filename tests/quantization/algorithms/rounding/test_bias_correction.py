from __future__ import annotations

import numpy as np
import pytest

from qtool.errors import QtoolError
from qtool.numerics.qparams import QUANT_TYPES, compute_qparams, dequantize, quantize, weight_range
from qtool.quantization.algorithms.rounding.bias_correction import bias_correction
from qtool.quantization.algorithms.rounding.gptq import weight_rows
from qtool.quantization.algorithms.rounding.patches import ConvGeometry, MatMulGeometry, input_stats
from tests.quantization.algorithms.rounding.brute import conv

INT4 = QUANT_TYPES["int4"]


def _int4_per_row(rows: np.ndarray) -> np.ndarray:
    qp = compute_qparams(*weight_range(rows, axis=0), INT4, symmetric=True, narrow_range=True, axis=0)
    return dequantize(quantize(rows, qp), qp)


def test_linear_layer_mean_error_vanishes_and_mse_drops_by_the_shift_squared():
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 1.0, (4096, 24)).astype(np.float32)
    w = rng.normal(size=(16, 24)).astype(np.float32)  # y = x @ w.T: rows are outputs
    wq = _int4_per_row(w)
    mean = input_stats(x, MatMulGeometry()).mean()
    correction = bias_correction(w, wq, mean).astype(np.float64)
    x64, delta = x.astype(np.float64), wq.astype(np.float64) - w
    before = x64 @ delta.T
    after = before + correction
    scale = np.abs(before).mean()
    np.testing.assert_allclose(after.mean(axis=0), 0.0, atol=1e-6 * scale)
    shift = delta @ x64.mean(axis=0)
    mse_drop = np.sum(before**2, axis=1).mean() - np.sum(after**2, axis=1).mean()
    assert np.sum(shift**2) > 1.0  # the correction matters: mean 5 makes the shift large
    assert mse_drop == pytest.approx(np.sum(shift**2), rel=1e-5)


def test_grouped_padded_conv_against_a_brute_force_float_conv():
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 1.0, (2, 4, 9, 8)).astype(np.float32)
    weight = rng.normal(size=(6, 2, 3, 3)).astype(np.float32)  # group=2
    bias = rng.normal(size=6).astype(np.float32)
    geometry = {"strides": (2, 1), "pads": (1, 1, 2, 0), "dilations": (1, 2), "group": 2}
    rows = weight_rows(weight, "Conv")
    quantized = _int4_per_row(rows).reshape(weight.shape)
    stats = input_stats(x, ConvGeometry((3, 3), **geometry))
    correction = bias_correction(rows, weight_rows(quantized, "Conv"), stats.mean())
    reference = conv(x, weight, bias, **geometry)
    plain = conv(x, quantized, bias, **geometry)
    corrected = conv(x, quantized, bias + correction, **geometry)
    shift = (plain - reference).mean(axis=0)
    assert np.abs(shift).max() > 0.05
    np.testing.assert_allclose((corrected - reference).mean(axis=0), 0.0, atol=1e-5)
    assert ((corrected - reference) ** 2).mean() < ((plain - reference) ** 2).mean()


def test_a_mean_of_the_wrong_size_is_refused():
    with pytest.raises(QtoolError, match="another node"):
        bias_correction(np.zeros((4, 3)), np.zeros((4, 3)), np.zeros(5))
