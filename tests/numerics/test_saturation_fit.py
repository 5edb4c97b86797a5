"""Pair saturation: the kernel's K order, the check, and the fit that keeps int8 weights exact on AVX2."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.numerics.qparams import QParams, dequantize, quant_type, quantize
from qtool.numerics.saturation import (
    COLUMNS,
    CONV,
    DEPTHWISE,
    PAIR_LIMIT,
    ROWS,
    fit_pairs,
    kernel_rows,
    overflowing_columns,
)
from qtool.quantization.algorithms.rounding.adaround import adaround
from qtool.quantization.algorithms.rounding.gptq import (
    RowGrid,
    gptq_round,
    hessian_factors,
    output_error,
    pair_partners,
    qparams_rows,
    rows_to_weight,
    weight_rows,
)
from qtool.quantization.algorithms.rounding.node_inputs import NodeInput
from qtool.quantization.algorithms.rounding.weight_rounding import ADAROUND, ADAROUND_WORK, _learned, _paired


def _vpmaddubsw_matmul(acts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """onnxruntime's AVX2 uint8 x int8 product: pairs along K summed in int16 (saturating), then int32."""
    k = rows.shape[1]
    padded = np.zeros((rows.shape[0], k + k % 2), np.int64)
    padded[:, :k] = rows
    a = np.zeros((acts.shape[0], k + k % 2), np.int64)
    a[:, :k] = acts
    pairs = a[:, None, 0::2] * padded[None, :, 0::2] + a[:, None, 1::2] * padded[None, :, 1::2]
    return np.clip(pairs, -32768, 32767).sum(-1)


def _per_channel(weight: np.ndarray, axis: int) -> QParams:
    amax = np.abs(np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)).max(1)
    scale = (amax / 127).astype(np.float32)
    return QParams(scale, np.zeros(scale.shape, np.int8), quant_type("int8"), axis, None, True)


def _sqnr(weight: np.ndarray, codes: np.ndarray, qp: QParams) -> float:
    error = weight - dequantize(codes, qp)
    return float(10 * np.log10((weight**2).sum() / (error**2).sum()))


def test_conv_weights_pair_along_kernel_position_then_channel():
    weight = np.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)  # [M, C, kH, kW]
    rows = kernel_rows(weight, CONV)
    assert rows is not None and rows.shape == (2, 12)
    for m, c, ky, kx in np.ndindex(*weight.shape):
        assert rows[m, (ky * 2 + kx) * 3 + c] == weight[m, c, ky, kx]  # K = position x C + channel


def test_matrix_layouts_read_each_output_column_along_k():
    b = np.arange(12).reshape(4, 3)  # MatMul B [K, N]
    assert np.array_equal(kernel_rows(b, COLUMNS), b.T)
    assert np.array_equal(kernel_rows(b.T, ROWS), b.T)  # Gemm transB: [N, K]
    assert kernel_rows(np.ones((8, 1, 3, 3)), DEPTHWISE) is None  # an exact kernel: no pairs


def test_a_weight_that_cannot_saturate_keeps_its_full_range_grid():
    rng = np.random.default_rng(1)
    weight = rng.normal(scale=0.002, size=(64, 16)).astype(np.float32)  # [K, N]
    weight[rng.integers(0, 64, 16), np.arange(16)] = 1.0  # one large weight per column
    qp = _per_channel(weight, 1)
    fitted, codes, fit = fit_pairs(weight, qp, COLUMNS, lambda grid: quantize(weight, grid))
    assert fit.overflowing == 0 and fit.rescaled == 0 and fit.coarsest == 1.0
    assert np.array_equal(fitted.scale, qp.scale) and np.array_equal(codes, quantize(weight, qp))
    assert np.abs(codes).max() == 127


@pytest.mark.parametrize(
    ("shape", "layout", "axis"), [((32, 16, 3, 3), CONV, 0), ((96, 40), COLUMNS, 1), ((40, 95), ROWS, 0)]
)
def test_fitted_weights_compute_exactly_in_the_saturating_kernel(shape, layout, axis):
    rng = np.random.default_rng(2)
    weight = rng.normal(size=shape).astype(np.float32)
    qp = _per_channel(weight, axis)
    nearest = quantize(weight, qp)
    assert overflowing_columns(nearest, layout) > 0  # full-range int8 could saturate here
    fitted, codes, fit = fit_pairs(weight, qp, layout, lambda grid: quantize(weight, grid))
    assert overflowing_columns(codes, layout) == 0 and fit.overflowing > 0
    rows = kernel_rows(codes, layout)
    assert rows is not None
    acts = rng.choice(np.array([0, 255]), size=(64, rows.shape[1]))  # the extremes of the codes
    exact = acts.astype(np.int64) @ rows.T.astype(np.int64)
    assert np.array_equal(_vpmaddubsw_matmul(acts, rows), exact)
    assert not np.array_equal(
        _vpmaddubsw_matmul(acts, kernel_rows(nearest, layout)), acts @ kernel_rows(nearest, layout).T.astype(np.int64)
    )
    # only the columns that could overflow are coarser, and by less than the reduced range's factor of 2
    changed = np.asarray(fitted.scale) > np.asarray(qp.scale)
    assert changed.sum() == fit.rescaled and 1.0 < fit.coarsest < 2.0
    reduced = QParams(qp.scale * 2, qp.zero_point, qp.qtype, axis, None, True)
    assert _sqnr(weight, codes, fitted) > _sqnr(weight, quantize(weight, reduced), reduced) + 1.5


def test_codes_rounded_past_the_limit_give_way_one_step_at_a_time():
    weight = np.array([[63.7, 64.2, 10.0, -63.6, -64.3, -127.0]], np.float32).T  # [K=6, N=1], scale 1
    qp = QParams(np.array([1.0], np.float32), np.zeros(1, np.int8), quant_type("int8"), 1, None, True)

    def rounded_up(grid: QParams) -> np.ndarray:  # a rounding algorithm that moves codes away from zero
        return quantize(np.sign(weight) * np.ceil(np.abs(weight) / grid.scale) * grid.scale, grid)

    _, codes, fit = fit_pairs(weight, qp, COLUMNS, rounded_up)
    pairs = codes[:, 0].astype(int).reshape(-1, 2)
    assert np.all(np.maximum(pairs, 0).sum(1) <= PAIR_LIMIT) and np.all(np.minimum(pairs, 0).sum(1) >= -PAIR_LIMIT)
    assert fit.nudged >= 1
    assert overflowing_columns(codes, COLUMNS) == 0


@pytest.mark.parametrize(
    ("shape", "layout", "kind", "axis"), [((32, 16, 3, 3), CONV, "Conv", 0), ((96, 40), COLUMNS, "MatMul", 1)]
)
def test_gptq_keeps_the_pairs_within_the_limit_when_that_errs_less_than_nudging_its_codes(shape, layout, kind, axis):
    rng = np.random.default_rng(3)
    weight = rng.normal(size=shape).astype(np.float32)
    rows = weight_rows(weight, kind)
    k = rows.shape[1]
    inputs = rng.normal(size=(4 * k, k)) @ rng.normal(size=(k, k)) * 0.3
    hessian = inputs.T @ inputs / len(inputs)  # correlated inputs: where GPTQ's compensation counts
    partners = pair_partners(weight.shape, kind, kernel_rows(np.arange(weight.size).reshape(shape), layout))
    assert partners is not None and (partners >= 0).sum() == k // 2
    qp = _per_channel(weight, axis)
    fitted, _, fit = fit_pairs(weight, qp, layout, lambda grid: quantize(weight, grid))
    assert fit.rescaled > 0
    scale, zero = qparams_rows(fitted, weight, kind)
    grid = RowGrid(scale, zero, fitted.qmin, fitted.qtype.qmax)
    factors = hessian_factors(hessian)
    free = gptq_round(rows, hessian, grid, factors=factors).codes
    assert overflowing_columns(rows_to_weight(free, shape, kind), layout) > 0  # GPTQ alone passes the limit
    inside = gptq_round(rows, hessian, RowGrid(scale, zero, -127, 127, None, partners, PAIR_LIMIT)).codes
    assert overflowing_columns(rows_to_weight(inside, shape, kind), layout) == 0  # kept within it in the loop
    layout_of = NodeInput("node", kind, "input", None)  # type: ignore[arg-type]
    chosen = _paired(weight, fitted, (rows, hessian, grid, factors), free, (partners, layout, layout_of))
    assert overflowing_columns(rows_to_weight(chosen, shape, kind), layout) == 0
    nearest = weight_rows(fit_pairs(weight, qp, layout, lambda grid: quantize(weight, grid))[1], kind)
    chosen_error, inside_error = (output_error(rows, c, grid, hessian) for c in (chosen, inside))
    assert chosen_error <= inside_error and chosen_error < output_error(rows, nearest, grid, hessian)


def test_codes_a_rounding_returns_transposed_are_still_brought_within_the_limit():
    # GPTQ's codes of a MatMul weight come back as a transposed view: the nudges must land in them all the same
    from qtool.numerics.saturation import codes_within_limit

    rng = np.random.default_rng(4)
    weight = rng.normal(size=(96, 40)).astype(np.float32)
    qp = _per_channel(weight, 1)
    transposed = np.asfortranarray(quantize(weight, qp).astype(np.int64))
    assert overflowing_columns(transposed, COLUMNS) > 0 and not transposed.flags["C_CONTIGUOUS"]
    codes, nudged = codes_within_limit(weight, qp, COLUMNS, lambda _: transposed)
    assert nudged > 0 and overflowing_columns(codes, COLUMNS) == 0


def test_adaround_keeps_the_pairs_within_the_limit_and_never_errs_more_than_its_start():
    rng = np.random.default_rng(5)
    shape, layout, kind = (16, 8, 3, 3), CONV, "Conv"
    weight = rng.normal(size=shape).astype(np.float32)
    rows = weight_rows(weight, kind)
    k = rows.shape[1]
    inputs = rng.normal(size=(4 * k, k)) @ rng.normal(size=(k, k)) * 0.3
    hessian = inputs.T @ inputs / len(inputs)
    partners = pair_partners(weight.shape, kind, kernel_rows(np.arange(weight.size).reshape(shape), layout))
    fitted, _, _ = fit_pairs(weight, _per_channel(weight, 0), layout, lambda grid: quantize(weight, grid))
    scale, zero = qparams_rows(fitted, weight, kind)
    grid = RowGrid(scale, zero, fitted.qmin, fitted.qtype.qmax)
    factors = hessian_factors(hessian)
    start = gptq_round(rows, hessian, RowGrid(scale, zero, -127, 127, None, partners, PAIR_LIMIT)).codes
    free = adaround(rows, hessian, grid, init=start, work=ADAROUND_WORK, schedule=ADAROUND).codes
    assert overflowing_columns(rows_to_weight(free, shape, kind), layout) > 0  # its own loss knows no pair limit
    layout_of = NodeInput("node", kind, "input", None)  # type: ignore[arg-type]
    learned = _learned(weight, fitted, (rows, hessian, grid, factors), start, (partners, layout, layout_of))
    assert overflowing_columns(rows_to_weight(learned, shape, kind), layout) == 0
    assert output_error(rows, learned, grid, hessian) < output_error(rows, start, grid, hessian)  # it learned
    # without a pair limit its codes are AdaRound's own
    assert np.array_equal(_learned(weight, fitted, (rows, hessian, grid, factors), start, None), free)
