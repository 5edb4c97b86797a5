"""Which int8 weights can saturate onnxruntime's uint8 x int8 kernels, and the per-node fit that prevents it.

On x86 CPUs without VNNI (AVX2; AVX-512 before Cascade Lake; AMD before Zen 4) onnxruntime's
uint8 x int8 kernels multiply with VPMADDUBSW, which adds the products of two weights that are
adjacent along the kernel's reduction axis (K index 2j and 2j+1, same output column) in int16 and
saturates. The activation codes that reach it are the raw stored codes, 0..255 (int8 activations
enter as code + 128), so a pair (w1, w2) of stored weight codes is safe whatever the input when
255 * (max(w1, 0) + max(w2, 0)) <= 32767 and 255 * (min(w1, 0) + min(w2, 0)) >= -32768, i.e. when the
same-signed part of every pair stays within [-128, 128] (:data:`PAIR_LIMIT`). VNNI, ARM and the
exact uint8 x uint8 and depthwise kernels have no such pairs.

The K order is the kernel's: [K, N] MatMul / Gemm weights pair along K; a Conv weight
[M, C/group, *kernel] pairs along (kernel position, channel) with the channel minor (onnxruntime
runs QLinearConv channels-last); a depthwise Conv (one input and one output channel per group)
runs an exact kernel. ``weight.saturation: auto`` keeps full-range int8 where no pair can
saturate and fits the rest (:func:`fit_pairs`): the channels whose pairs could overflow get the
smallest coarser scale that keeps every pair within the limit, and the few pairs that rounding
still pushes over lose one step on the code that was rounded up most. The result is int8 codes
that compute the same on every CPU, at int8 speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qtool.numerics.qparams import QParams
from qtool.schemes import PairGuard, Saturation

PAIR_LIMIT = 32767 // 255  # 128: the largest same-signed pair sum of int8 codes that 0..255 codes cannot overflow

# How an integer kernel reads a weight along its reduction axis (see :func:`kernel_rows`).
COLUMNS = "columns"  # [..., K, N]: MatMul B, Gemm B without transB
ROWS = "rows"  # [N, K]: Gemm B with transB
CONV = "conv"  # [M, C/group, *kernel]: K = (kernel position, channel), channel minor
DEPTHWISE = "depthwise"  # one input and one output channel per group: an exact kernel, no pairs


def kernel_rows(array: np.ndarray, layout: str) -> np.ndarray | None:
    """``array`` (a weight's shape) as [columns, K] in the kernel's K order; None for a kernel without pairs."""
    if layout == DEPTHWISE:
        return None
    if layout == CONV:
        return np.moveaxis(array, 1, -1).reshape(array.shape[0], -1)
    if layout == ROWS:
        return array.reshape(array.shape[0], -1)
    k = array.shape[-2]
    return np.swapaxes(array, -1, -2).reshape(-1, k)


def _pairs(rows: np.ndarray) -> np.ndarray:
    """[columns, K] -> [columns, ceil(K / 2), 2] (an odd K's last code meets the kernel's zero padding)."""
    if rows.shape[1] % 2:
        rows = np.concatenate([rows, np.zeros((rows.shape[0], 1), rows.dtype)], axis=1)
    return rows.reshape(rows.shape[0], -1, 2)


def pair_extremes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column: the largest positive and the most negative same-signed pair sum."""
    pairs = _pairs(rows.astype(np.float64))
    return np.maximum(pairs, 0).sum(-1).max(-1), np.minimum(pairs, 0).sum(-1).min(-1)


def overflowing_columns(codes: np.ndarray, layout: str) -> int:
    """How many output columns hold a pair of stored int8 codes that can saturate (0 for a kernel without pairs)."""
    rows = kernel_rows(codes, layout)
    if rows is None or rows.size == 0:
        return 0
    high, low = pair_extremes(rows)
    return int(np.count_nonzero((high > PAIR_LIMIT) | (low < -PAIR_LIMIT)))


@dataclass(frozen=True)
class PairFit:
    """What :func:`fit_pairs` did to one weight copy."""

    columns: int  # output columns the kernel computes
    overflowing: int  # columns that could saturate with the nearest codes on the full grid
    rescaled: int  # columns given a coarser scale
    coarsest: float  # the largest scale factor applied (1.0: none)
    nudged: int  # codes moved one step toward zero afterwards

    @property
    def bits_lost(self) -> float:
        """log2 of the coarsest factor: what the fit cost the worst column, in bits of resolution."""
        return float(np.log2(self.coarsest))


FACTOR_STEPS = 9  # scale factors tried per column, evenly from 1 (clip the offending pairs) to the full fit


def fit_pairs(
    values: np.ndarray,
    qp: QParams,
    layout: str,
    round_codes: Callable[[QParams], np.ndarray],
    round_fitted: Callable[[QParams], np.ndarray] | None = None,
) -> tuple[QParams, np.ndarray, PairFit]:
    """The qparams and int8 codes of ``values`` (symmetric, zero point 0) with no pair above :data:`PAIR_LIMIT`.

    ``round_codes`` rounds ``values`` onto a grid (nearest, or the readers' rounding algorithm).
    Columns whose codes fit keep ``qp``. For the others, each of :data:`FACTOR_STEPS` scale factors
    from 1 to the one at which the column's largest pair sum is exactly the limit is tried: the
    codes are rounded at that scale and every pair still over the limit gives its excess back on
    its two codes (see :func:`_give_way`). Each column keeps the factor with the least squared
    error: a coarser scale when many pairs are too large, a few clipped pairs when only those are.
    The readers' rounding then runs at the chosen scales (:func:`codes_within_limit`): ``round_fitted``
    when given (GPTQ keeping the pairs within the limit itself, compensating the few it clips), else
    ``round_codes``.
    """
    codes = round_codes(qp)
    index = kernel_rows(np.arange(codes.size).reshape(codes.shape), layout)
    if index is None or index.size == 0:
        return qp, codes, PairFit(0, 0, 0, 1.0, 0)
    overflowing = overflowing_columns(codes, layout)
    if not overflowing:
        return qp, codes, PairFit(index.shape[0], 0, 0, 1.0, 0)
    in_steps = np.broadcast_to(values.astype(np.float64) / _per_element(qp, codes.shape), codes.shape)
    per_channel = _per_channel(qp, codes.ndim, layout, index.shape[0])
    factor = _best_factors(in_steps.reshape(-1)[index], per_channel)
    scale = np.asarray(qp.scale, np.float64)
    scale = scale * (factor.reshape(scale.shape) if per_channel else factor.max())
    fitted = QParams(scale.astype(np.float32), qp.zero_point, qp.qtype, qp.axis, qp.block_size, qp.narrow)
    codes, nudged = codes_within_limit(values, fitted, layout, round_fitted or round_codes)
    rescaled = int(np.count_nonzero(factor > 1.0))
    return fitted, codes, PairFit(index.shape[0], overflowing, rescaled, float(np.max(factor)), nudged)


def codes_within_limit(
    values: np.ndarray, qp: QParams, layout: str, round_codes: Callable[[QParams], np.ndarray]
) -> tuple[np.ndarray, int]:
    """``values`` rounded onto ``qp`` by ``round_codes``, every pair then brought within the limit; and the steps."""
    # C order: the nudges land through a flat view (a rounding algorithm's codes of a MatMul weight come transposed,
    # and the flat reshape of those would be a copy, dropping every nudge)
    codes = np.array(round_codes(qp), copy=True, order="C")
    index = kernel_rows(np.arange(codes.size).reshape(codes.shape), layout)
    if index is None or index.size == 0:
        return codes, 0
    real = np.broadcast_to(values.astype(np.float64) / _per_element(qp, codes.shape), codes.shape).reshape(-1)
    flat = codes.reshape(-1)
    rows = flat[index].astype(np.int64)
    nudged = _give_way(rows, real[index])
    flat[index] = rows.astype(flat.dtype)
    return codes, nudged


def _per_channel(qp: QParams, rank: int, layout: str, columns: int) -> bool:
    """Whether ``qp`` has one scale per kernel column (so each column's factor is its own)."""
    scale = np.asarray(qp.scale)
    natural = rank - 1 if layout == COLUMNS else 0
    return scale.size > 1 and qp.axis is not None and qp.axis % rank == natural and scale.size == columns


def _best_factors(real_rows: np.ndarray, per_channel: bool) -> np.ndarray:
    """The scale factor of each kernel column (one for all without per-channel scales) with the least error.

    ``real_rows`` are the weights in steps of the full-range scale, [columns, K] in the kernel's order.
    """
    high, low = pair_extremes(real_rows)
    need = np.maximum(1.0, np.maximum(high, -low) / PAIR_LIMIT)
    if not per_channel:
        need = np.full_like(need, need.max())
    elif np.any(need <= 1.0):  # a column whose pairs fit keeps factor 1 at every step: only the others are tried
        best = np.ones_like(need)
        fitted = np.nonzero(need > 1.0)[0]
        if fitted.size:
            best[fitted] = _best_factors(real_rows[fitted], per_channel)
        return best
    best_error = np.full(need.shape, np.inf)
    best = np.ones_like(need)
    for t in np.linspace(0.0, 1.0, FACTOR_STEPS):
        factor = 1.0 + (need - 1.0) * t
        scaled = real_rows / factor[:, None]
        codes = np.clip(np.rint(scaled), -127, 127).astype(np.int64)
        _give_way(codes, scaled)
        error = (((scaled - codes) * factor[:, None]) ** 2).sum(axis=1)
        if not per_channel:
            error = np.full_like(error, error.sum())
        better = error < best_error
        best_error[better], best[better] = error[better], factor[better]
    return best


def _give_way(rows: np.ndarray, real: np.ndarray) -> int:
    """Step codes toward zero until no pair of ``rows`` ([columns, K] codes) exceeds the limit; returns the steps.

    A single int8 code never exceeds the limit, so an offending pair has two codes of its sign, and
    its excess is split between them to add the least squared error (``real``: the values in steps):
    the code rounded up more gives more.
    """
    if rows.shape[1] % 2:  # an odd K's last code meets the kernel's zero padding
        padded, padded_real = np.pad(rows, ((0, 0), (0, 1))), np.pad(real, ((0, 0), (0, 1)))
        steps = _give_way(padded, padded_real)
        rows[:] = padded[:, :-1]
        return steps
    pairs = rows.reshape(rows.shape[0], -1, 2)  # a view: the steps land in ``rows``
    pair_real = real.reshape(pairs.shape)
    steps = 0
    first_code, second_code = pairs[..., 0], pairs[..., 1]
    for sign in (1, -1):
        # both codes of this sign (two comparisons: numpy's min over an axis of 2 costs several times more)
        both = (first_code > 0) & (second_code > 0) if sign == 1 else (first_code < 0) & (second_code < 0)
        cols, slots = np.nonzero(both)
        if cols.size == 0:
            continue
        codes = pairs[cols, slots].astype(np.int64) * sign
        excess = codes.sum(-1) - PAIR_LIMIT
        over = excess > 0
        cols, slots, codes, excess = cols[over], slots[over], codes[over], excess[over]
        if cols.size == 0:
            continue
        up = codes - pair_real[cols, slots] * sign  # how far each code was rounded up
        first = np.rint((excess + up[:, 0] - up[:, 1]) / 2).astype(np.int64)
        first = np.clip(first, np.maximum(0, excess - codes[:, 1]), np.minimum(excess, codes[:, 0]))
        codes[:, 0] -= first
        codes[:, 1] -= excess - first
        pairs[cols, slots] = codes * sign
        steps += int(excess.sum())
    return steps


def _per_element(qp: QParams, shape: tuple[int, ...]) -> np.ndarray:
    """The scale of each weight element, broadcastable to ``shape`` (as DequantizeLinear applies it)."""
    length = shape[qp.axis] if qp.axis is not None else 0
    return qp.expand(np.asarray(qp.scale, np.float64), len(shape), length)


# How an integer kernel's 8-bit weight was stored against the pair limit, as the reports name it.
FULL: PairGuard = "int8"  # full range, no pair can saturate
FITTED: PairGuard = "int8 fitted"  # full range but for the channels fitted to the pair limit
EXACT_KERNEL: PairGuard = "int8 (exact kernel)"  # depthwise: no pairs
AS_UINT8: PairGuard = "uint8"  # stored as uint8 (exact uint8 x uint8 kernels, slower with VNNI)
REDUCED: PairGuard = "int8 reduced"  # [-64, 63]
UNGUARDED: PairGuard = "int8 unguarded"  # weight.saturation: ignore (VNNI / ARM deployments)


def pair_guard(
    saturation: Saturation | None, dtype: str, reduced: bool, layout: str | None, fit: PairFit | None
) -> PairGuard:
    """How an integer kernel's 8-bit weight was stored against pair saturation."""
    if dtype == "uint8":
        return AS_UINT8
    if reduced:
        return REDUCED
    if saturation == "fit":
        if layout == DEPTHWISE:
            return EXACT_KERNEL
        return FITTED if fit is not None and fit.rescaled + fit.nudged > 0 else FULL
    return UNGUARDED
