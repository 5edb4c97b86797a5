from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qtool.errors import QtoolError
from qtool.numerics.qparams import (
    QUANT_TYPES,
    QParams,
    compute_qparams,
    dequantize,
    quantize,
    weight_range,
)
from qtool.quantization.algorithms.rounding.gptq import RowGrid, gptq_round, qparams_rows, rows_to_weight, weight_rows

INT4, UINT8 = QUANT_TYPES["int4"], QUANT_TYPES["uint8"]


def _per_row(rows: np.ndarray, qtype=INT4, symmetric: bool = True) -> QParams:
    lo, hi = weight_range(rows, axis=0)
    return compute_qparams(lo, hi, qtype, symmetric=symmetric, narrow_range=symmetric, axis=0)


def _correlated_inputs(k: int, samples: int, seed: int) -> np.ndarray:
    """[K, samples]: a rank-8 signal plus a little noise, the structure GPTQ exploits."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(k, 8)) @ rng.normal(size=(8, samples)) + 0.1 * rng.normal(size=(k, samples))


def _output_error(codes: np.ndarray, rows: np.ndarray, qp: QParams, x: np.ndarray) -> float:
    return float(np.sum(((dequantize(codes, qp).astype(np.float64) - rows) @ x) ** 2))


def test_identity_hessian_gives_exactly_nearest_rounding():
    weight = np.random.default_rng(0).normal(size=(8, 4, 3, 3)).astype(np.float32)
    rows = weight_rows(weight, "Conv")
    for qtype, symmetric in ((INT4, True), (UINT8, False)):
        qp = _per_row(rows, qtype, symmetric)
        result = gptq_round(rows, np.eye(rows.shape[1]), RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax))
        np.testing.assert_array_equal(result.codes, quantize(rows, qp))
        assert result.method == "gptq" and result.dead_columns == 0


def test_correlated_inputs_halve_the_output_error_at_int4():
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(32, 64)).astype(np.float32)
    x = _correlated_inputs(64, 2048, seed=2)
    qp = _per_row(rows)
    result = gptq_round(rows, x @ x.T / x.shape[1], RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax), block=16)
    assert result.codes.min() >= qp.qmin and result.codes.max() <= qp.qtype.qmax
    nearest = _output_error(quantize(rows, qp), rows, qp, x)
    assert _output_error(result.codes, rows, qp, x) * 2 <= nearest


def test_block_does_not_change_the_result():
    rows = np.random.default_rng(3).normal(size=(4, 40)).astype(np.float32)
    x = _correlated_inputs(40, 500, seed=4)
    qp = _per_row(rows)
    a = gptq_round(rows, x @ x.T, RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax), block=7).codes
    b = gptq_round(rows, x @ x.T, RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax), block=128).codes
    np.testing.assert_array_equal(a, b)


def test_a_dead_input_column_is_rounded_to_nearest():
    rows = np.random.default_rng(5).normal(size=(16, 32)).astype(np.float32)
    x = _correlated_inputs(32, 1024, seed=6)
    x[5] = 0.0
    qp = _per_row(rows)
    result = gptq_round(rows, x @ x.T, RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax))
    nearest = quantize(rows, qp)
    np.testing.assert_array_equal(result.codes[:, 5], nearest[:, 5])
    assert result.dead_columns == 16
    assert _output_error(result.codes, rows, qp, x) * 2 <= _output_error(nearest, rows, qp, x)


def test_per_block_scales_stay_on_their_grid():
    rng = np.random.default_rng(7)
    weight = rng.normal(size=(64, 12)).astype(np.float32)  # MatMul B [K, N], blocks of 16 along K
    lo, hi = weight_range(weight, axis=0, block_size=16)
    qp = dataclasses.replace(compute_qparams(lo, hi, INT4, symmetric=True, narrow_range=True, axis=0), block_size=16)
    rows = weight_rows(weight, "MatMul")
    scale, zero = qp.scale.T, qp.zero_point.T  # [N, K / 16]
    identity = gptq_round(rows, np.eye(64), RowGrid(scale, zero, qp.qmin, qp.qtype.qmax, block_size=16))
    np.testing.assert_array_equal(rows_to_weight(identity.codes, weight.shape, "MatMul"), quantize(weight, qp))
    full_scale, full_zero = qparams_rows(qp, weight, "MatMul")
    x = _correlated_inputs(64, 1024, seed=8)
    blocked = gptq_round(rows, x @ x.T, RowGrid(scale, zero, qp.qmin, qp.qtype.qmax, block_size=16))
    expanded = gptq_round(rows, x @ x.T, RowGrid(full_scale, full_zero, qp.qmin, qp.qtype.qmax))
    np.testing.assert_array_equal(blocked.codes, expanded.codes)
    codes = rows_to_weight(blocked.codes, weight.shape, "MatMul")
    error = float(np.sum(((dequantize(codes, qp) - weight).T.astype(np.float64) @ x) ** 2))
    nearest = float(np.sum(((dequantize(quantize(weight, qp), qp) - weight).T.astype(np.float64) @ x) ** 2))
    assert error * 2 <= nearest


def test_grouped_conv_uses_each_groups_own_hessian():
    weight = np.random.default_rng(9).normal(size=(8, 3, 2, 2)).astype(np.float32)  # group=2: 4 rows per group
    rows = weight_rows(weight, "Conv")
    qp = _per_row(rows)
    xs = [_correlated_inputs(12, 512, seed=10 + g) for g in range(2)]
    hessian = np.stack([x @ x.T for x in xs])
    result = gptq_round(rows, hessian, RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax))
    for g, x in enumerate(xs):
        part = slice(4 * g, 4 * g + 4)
        alone = gptq_round(rows[part], x @ x.T, RowGrid(qp.scale[part], qp.zero_point[part], qp.qmin, qp.qtype.qmax))
        np.testing.assert_array_equal(result.codes[part], alone.codes)
    depthwise = gptq_round(rows, np.stack([np.eye(12)] * 8), RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax))
    np.testing.assert_array_equal(depthwise.codes, quantize(rows, qp))


def test_cholesky_failure_retries_with_more_damping_then_falls_back_to_nearest():
    rows = np.array([[0.3, -0.7], [0.55, 0.1]], np.float32)
    qp = _per_row(rows)
    retried = gptq_round(
        rows, np.array([[1.0, 5.0], [5.0, 1.0]]), RowGrid(qp.scale, qp.zero_point, qp.qmin, qp.qtype.qmax)
    )
    assert retried.method == "gptq" and retried.damp == pytest.approx(10.0)
    hopeless = gptq_round(rows, np.array([[1.0, 20.0], [20.0, 1.0]]), RowGrid(qp.scale, qp.zero_point, qp.qmin, 7))
    assert hopeless.method == "nearest" and hopeless.nearest_groups == 1
    np.testing.assert_array_equal(hopeless.codes, quantize(rows, qp))


def test_weight_layouts_round_trip():
    rng = np.random.default_rng(11)
    conv = rng.normal(size=(6, 2, 3, 3))
    np.testing.assert_array_equal(rows_to_weight(weight_rows(conv, "Conv"), conv.shape, "Conv"), conv)
    b = rng.normal(size=(5, 7))  # MatMul / Gemm B [K, N]: rows are the N outputs
    assert weight_rows(b, "MatMul").shape == (7, 5)
    np.testing.assert_array_equal(rows_to_weight(weight_rows(b, "Gemm"), b.shape, "Gemm"), b)
    np.testing.assert_array_equal(weight_rows(b, "Gemm", trans_b=True), b)
    qp = compute_qparams(*weight_range(b, axis=1), INT4, symmetric=True, narrow_range=True, axis=1)
    scale, _ = qparams_rows(qp, b, "MatMul")
    np.testing.assert_array_equal(scale, np.broadcast_to(qp.scale[:, None], (7, 5)))


def test_a_hessian_of_the_wrong_size_is_refused():
    with pytest.raises(QtoolError, match="another node"):
        gptq_round(np.zeros((4, 3), np.float32), np.eye(4), RowGrid(1.0, 0, -8, 7))


@pytest.mark.parametrize(("groups", "k"), [(1, 700), (3, 250), (40, 9)])
def test_the_upper_factor_inverse_by_halves_is_the_inverse(groups, k):
    from qtool.quantization.algorithms.rounding.gptq import _upper_inverse

    rng = np.random.default_rng(k)
    x = rng.normal(size=(groups, 2 * k, k)) * rng.uniform(0.1, 3.0, k)
    factor = np.linalg.cholesky(np.einsum("gij,gik->gjk", x, x) + np.eye(k)).transpose(0, 2, 1)  # upper
    inverse = _upper_inverse(np.ascontiguousarray(factor))
    assert np.array_equal(inverse, np.triu(inverse))  # upper, its lower part exact zeros
    np.testing.assert_allclose(np.matmul(inverse, factor), np.broadcast_to(np.eye(k), factor.shape), atol=1e-9)
    np.testing.assert_allclose(inverse, np.linalg.inv(factor), rtol=0, atol=1e-12 * np.abs(inverse).max())
