"""GPTQ: round a weight column by column, pushing each column's error onto the columns not yet rounded.

With the input Hessian ``H = E[x x^T]``, rounding column ``k`` and then correcting the
remaining columns by ``-(error / U_kk) U_k,k+1:`` (``U`` the upper Cholesky factor of
``H^-1``) minimises ``||(Q - W) X||^2`` greedily instead of ``||Q - W||^2``
(Frantar et al., 2022). The scale and zero point are fixed inputs: GPTQ only picks
different integers on the same grid as nearest rounding, so the caller's qparams stay valid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from qtool.errors import QtoolError
from qtool.numerics.qparams import QParams

log = logging.getLogger(__name__)

WeightKind = Literal["Conv", "MatMul", "Gemm"]
DAMP_RETRIES = 3  # damping x10 this many times when the Cholesky factorisation fails
_INVERSE_BLOCK = 96  # triangular blocks up to this width are inverted directly


@dataclass(frozen=True, eq=False)
class GptqResult:
    """The integer codes GPTQ chose, and how it got there."""

    codes: np.ndarray  # int64 [rows, K], on the caller's grid
    damp: float  # the largest relative damping a group needed
    nearest_groups: int  # groups whose Hessian never factorised: their codes are nearest rounding
    dead_columns: int  # inputs that were always zero: their codes are nearest rounding

    @property
    def method(self) -> str:
        return "gptq" if self.nearest_groups == 0 else "nearest"


def weight_rows(weight: np.ndarray, kind: WeightKind, *, trans_b: bool = False) -> np.ndarray:
    """A weight as [rows, K]: one row per output, K along the reduction (Conv: channel, kernel... order)."""
    if kind == "Conv":
        return weight.reshape(weight.shape[0], -1)
    if kind == "Gemm" and trans_b:  # B is [N, K]
        return weight
    if weight.ndim != 2:
        raise QtoolError(f"{kind} weight of shape {weight.shape} is not 2-D", hint="keep this node out of GPTQ")
    return weight.T  # B is [K, N]


def rows_to_weight(rows: np.ndarray, shape: tuple[int, ...], kind: WeightKind, *, trans_b: bool = False) -> np.ndarray:
    """The inverse of :func:`weight_rows`: [rows, K] back to the weight's own ``shape``."""
    if kind == "Conv" or (kind == "Gemm" and trans_b):
        return rows.reshape(shape)
    return rows.T.reshape(shape)


def qparams_rows(
    qp: QParams, weight: np.ndarray, kind: WeightKind, *, trans_b: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``qp``'s scale and zero point expanded to the weight's [rows, K] layout."""
    length = weight.shape[qp.axis] if qp.axis is not None else 0
    scale = np.broadcast_to(qp.expand(qp.scale, weight.ndim, length), weight.shape)
    zero = np.broadcast_to(qp.expand(qp.zero_point.astype(np.int64), weight.ndim, length), weight.shape)
    return weight_rows(scale, kind, trans_b=trans_b), weight_rows(zero, kind, trans_b=trans_b)


def _per_column(values: np.ndarray | float, rows: int, k: int, block_size: int | None) -> np.ndarray:
    """Scale or zero point broadcast to [rows, K]: scalar, per row, per element or per block of K."""
    array = np.asarray(values)
    if block_size is not None:
        array = array.reshape(rows, -1)
        array = np.repeat(array, block_size, axis=1)[:, :k]
    elif array.ndim == 1:
        array = array[:, None]
    return np.broadcast_to(array, (rows, k))


def round_nearest(
    weight_rows: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, qmin: int, qmax: int
) -> np.ndarray:
    """QuantizeLinear's rounding of [rows, K] with per-element scale and zero point (all [rows, K])."""
    steps = np.rint(weight_rows.astype(np.float32) / scale)
    zero = zero_point.astype(np.int64)
    steps = np.clip(steps, qmin - zero, qmax - zero)
    return steps.astype(np.int64) + zero


@dataclass(frozen=True)
class RowGrid:
    """The integer grid of weight rows [rows, K] that GPTQ and AdaRound round onto."""

    scale: np.ndarray | float  # float32: a scalar, per row [rows], per element [rows, K], or per block of K
    zero_point: np.ndarray | int  # shaped like ``scale``
    qmin: int  # the smallest code (``QParams.qmin``, which honours a narrow range)
    qmax: int  # the largest code
    block_size: int | None = None  # the block length along K of a per-block scale [rows, ceil(K / block_size)]
    # the integer kernel's weight pairs (see qtool.numerics.saturation): for each column k, the
    # earlier column whose code it is added to in int16 (-1: none), so that GPTQ keeps every pair's same-signed
    # part within ``pair_limit`` itself and pushes what that clipping costs onto the columns not yet rounded
    partners: np.ndarray | None = None
    pair_limit: int | None = None

    def per_element(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point as [rows, K]."""
        scale = _per_column(np.asarray(self.scale, np.float32), rows, k, self.block_size)
        return scale, _per_column(np.asarray(self.zero_point, np.int64), rows, k, self.block_size)


def gptq_round(
    weight_rows: np.ndarray,
    hessian: np.ndarray,
    grid: RowGrid,
    *,
    damp: float = 0.01,
    block: int = 128,
    factors: HessianFactors | None = None,
) -> GptqResult:
    """Integer codes for ``weight_rows`` that minimise the output error on inputs with ``hessian``.

    Args:
        weight_rows: the float weight as [rows, K] (see :func:`weight_rows`).
        hessian: ``E[x x^T]`` as [K, K], or [groups, K, K] for grouped Conv (rows split evenly).
        grid: the scale, zero point and code range to round onto.
        damp: added to H's diagonal as a fraction of its mean, for a stable inverse.
        block: columns updated together (speed only; the result does not depend on it).
        factors: :func:`hessian_factors` of ``hessian``, when the caller keeps them for several grids.

    Returns:
        The codes, on the same grid as nearest rounding with this scale and zero point.
    """
    w = np.asarray(weight_rows, np.float32)
    rows, k = w.shape
    if factors is None:
        factors = hessian_factors(hessian, damp)
    groups = factors.upper.shape[0]
    if factors.upper.shape[1:] != (k, k) or rows % groups:
        raise QtoolError(
            f"a Hessian of shape {np.shape(hessian)} does not fit a weight of {rows} rows x {k} columns",
            hint="the input statistics were collected for another node",
        )
    scale_full, zero_full = grid.per_element(rows, k)
    qmin, qmax = grid.qmin, grid.qmax
    codes = round_nearest(w, scale_full, zero_full, qmin, qmax)
    pairs = None if grid.partners is None or grid.pair_limit is None else (grid.partners, grid.pair_limit)
    upper, damps, dead = factors.upper, factors.damps, factors.dead
    ok = ~np.isnan(damps)
    shape = (groups, rows // groups, k)
    if ok.any():
        gptq_codes = _gptq_columns(
            w.reshape(shape)[ok],
            upper[ok],
            scale_full.reshape(shape)[ok],
            zero_full.reshape(shape)[ok],
            qmin,
            qmax,
            block,
            pairs,
        )
        grouped = codes.reshape(shape)
        # A dead column is independent of the others (H is block diagonal there); nearest rounding makes that exact.
        grouped[ok] = np.where(dead[ok][:, None, :], grouped[ok], gptq_codes)
        codes = grouped.reshape(rows, k)
    nearest = int((~ok).sum())
    if nearest:
        log.warning("GPTQ: %d of %d weight groups have a singular Hessian; they use nearest rounding", nearest, groups)
    used_damp = float(np.nanmax(damps)) if ok.any() else damp * 10**DAMP_RETRIES
    return GptqResult(codes, used_damp, nearest, int(dead.sum()) * (rows // groups))


@dataclass(frozen=True, eq=False)
class HessianFactors:
    """What GPTQ needs of a Hessian, whatever the grid: the factors of its damped inverse, per group."""

    upper: np.ndarray  # [groups, K, K]
    damps: np.ndarray  # [groups]: the damping each group needed (NaN: none worked, nearest rounding)
    dead: np.ndarray  # [groups, K]: inputs that were always zero


def hessian_factors(hessian: np.ndarray, damp: float = 0.01) -> HessianFactors:
    """Factor ``hessian`` ([K, K] or [groups, K, K]) once for :func:`gptq_round` on any grid."""
    h = np.asarray(hessian, np.float64)
    h = h[None] if h.ndim == 2 else h
    dead = np.diagonal(h, axis1=1, axis2=2) <= 0
    upper, damps = _inverse_factors(h, dead, damp)
    return HessianFactors(upper, damps, dead)


def _inverse_factors(h: np.ndarray, dead: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper Cholesky factors of the damped ``H^-1`` per group, and the damping each needed (NaN: none worked).

    ``dead``: the inputs that were always zero, whose diagonal counts as 1. All groups are factorised together
    first (depthwise Conv has hundreds of tiny ones); only when that fails does each group retry alone with 10x
    more damping.
    """
    try:
        return _damped_factor(h, dead, damp), np.full(len(h), damp)
    except np.linalg.LinAlgError:
        pass
    upper = np.zeros_like(h)
    damps = np.full(len(h), np.nan)
    for g in range(len(h)):
        for attempt in range(DAMP_RETRIES + 1):
            try:
                upper[g] = _damped_factor(h[g : g + 1], dead[g : g + 1], damp * 10**attempt)[0]
            except np.linalg.LinAlgError:
                continue
            damps[g] = damp * 10**attempt
            break
    return upper, damps


def _damped_factor(h: np.ndarray, dead: np.ndarray, relative: float) -> np.ndarray:
    """[groups, K, K] Hessians -> upper ``U`` with ``U^T U = (H + relative * mean(diag H) * I)^-1``.

    ``dead`` inputs' diagonal counts as 1 (in the mean too).
    """
    k = h.shape[-1]
    diagonal = np.where(dead, 1.0, np.diagonal(h, axis1=1, axis2=2))
    mean_diag = diagonal.mean(axis=1)
    # the Cholesky factor of H with its order reversed, reversed back, is upper: H = R R^T, so U = R^-1 gives
    # U^T U = H^-1 (one factorisation and one inverse, not an inverse, a product and a second factorisation);
    # one copy of H, reversed and damped in place, and the factor inverted as the view it is reversed, so that a
    # large Conv's factoring holds few [K, K] arrays at once
    damped = np.ascontiguousarray(h[:, ::-1, ::-1])
    damped[:, np.arange(k), np.arange(k)] = (diagonal + (relative * mean_diag)[:, None])[:, ::-1]
    reversed_factor = np.linalg.cholesky(damped)
    del damped
    upper = _upper_inverse(reversed_factor[:, ::-1, ::-1])
    if not np.all(np.isfinite(upper)):
        raise np.linalg.LinAlgError("non-finite Cholesky factor")
    return upper


def _upper_inverse(upper: np.ndarray) -> np.ndarray:
    """The inverse of upper-triangular [groups, K, K] matrices, by halves.

    ``[[A, B], [0, C]]^-1 = [[A^-1, -A^-1 B C^-1], [0, C^-1]]``: a third of a general inverse's work, in matrix
    products (a 2304-wide factor: 0.1 s, where ``np.linalg.inv`` took 0.5 s); small blocks go to ``np.linalg.inv``.
    ``upper`` may be a view (a reversed factor): only quarter-size blocks of it are copied.
    """
    k = upper.shape[-1]
    if k <= _INVERSE_BLOCK:
        return np.linalg.inv(upper)
    half = k // 2
    inverse = np.zeros(upper.shape, upper.dtype)
    first = inverse[:, :half, :half] = _upper_inverse(np.ascontiguousarray(upper[:, :half, :half]))
    last = inverse[:, half:, half:] = _upper_inverse(np.ascontiguousarray(upper[:, half:, half:]))
    corner = np.ascontiguousarray(upper[:, :half, half:])
    inverse[:, :half, half:] = -np.matmul(np.matmul(first, corner), last)
    return inverse


def _gptq_columns(
    w: np.ndarray,
    upper: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    qmin: int,
    qmax: int,
    block: int,
    pairs: tuple[np.ndarray, int] | None = None,
) -> np.ndarray:
    """The GPTQ loop over [groups, rows, K] weights with [groups, K, K] factors -> codes of that shape.

    ``pairs``: each column's earlier pair partner (-1: none) and the limit of a pair's same-signed sum
    of codes (relative to the zero point): a code that would pass it is clipped, and its error is
    compensated like any rounding error.
    """
    work = w.astype(np.float64)
    k = work.shape[2]
    codes = np.empty(work.shape, np.int64)
    for start in range(0, k, block):
        stop = min(start + block, k)
        chunk = work[:, :, start:stop].copy()
        errors = np.zeros_like(chunk)
        u = upper[:, start:stop, start:stop]
        for i in range(stop - start):
            column = start + i
            q = round_nearest(chunk[:, :, i], scale[:, :, column], zero[:, :, column], qmin, qmax)
            if pairs is not None and pairs[0][column] >= 0:
                q = _within_pair_limit(q, codes[:, :, pairs[0][column]], zero[:, :, column], pairs[1])
            codes[:, :, column] = q
            dequantized = ((q - zero[:, :, column]).astype(np.float32) * scale[:, :, column]).astype(np.float64)
            error = (chunk[:, :, i] - dequantized) / u[:, i, i, None]
            chunk[:, :, i:] -= error[:, :, None] * u[:, None, i, i:]
            errors[:, :, i] = error
        work[:, :, stop:] -= errors @ upper[:, start:stop, stop:]
    return codes


def output_error(weight_rows: np.ndarray, codes: np.ndarray, grid: RowGrid, hessian: np.ndarray) -> float:
    """``tr(E H E^T)`` of the dequantized ``codes`` against ``weight_rows`` ([rows, K]): what GPTQ minimises."""
    rows, k = weight_rows.shape
    scale, zero = grid.per_element(rows, k)
    error = (codes - zero).astype(np.float64) * scale - weight_rows
    h = np.asarray(hessian, np.float64)
    h = h[None] if h.ndim == 2 else h
    grouped = error.reshape(len(h), rows // len(h), k)
    return float(np.einsum("grk,gkl,grl->", grouped, h, grouped))


def _within_pair_limit(q: np.ndarray, partner: np.ndarray, zero: np.ndarray, limit: int) -> np.ndarray:
    """Codes ``q`` clipped so that with their partner's codes no same-signed pair passes ``limit`` (steps from zero)."""
    steps, other = q - zero, partner - zero
    steps = np.where((steps > 0) & (other > 0), np.minimum(steps, limit - other), steps)
    steps = np.where((steps < 0) & (other < 0), np.maximum(steps, -limit - other), steps)
    return steps + zero


def pair_partners(
    shape: tuple[int, ...], kind: WeightKind, kernel_rows_of: np.ndarray, *, trans_b: bool = False
) -> np.ndarray | None:
    """For each column of :func:`weight_rows`' K order, its earlier partner in the kernel's pairs (-1: none).

    ``kernel_rows_of``: the weight's flat element indices (``arange(size).reshape(shape)``) in the integer
    kernel's [columns, K] order, whose adjacent K entries 2j and 2j+1 form its pairs. None when the two
    orders do not hold the same elements in their first row (a layout this does not know).
    """
    index = np.arange(int(np.prod(shape))).reshape(shape)
    ours = weight_rows(index, kind, trans_b=trans_b)[0]
    kernel = kernel_rows_of[0]
    if ours.shape != kernel.shape or not np.array_equal(np.sort(ours), np.sort(kernel)):
        return None
    position = np.empty(int(ours.max()) + 1, np.int64)
    position[ours] = np.arange(ours.size)
    pairs = position[kernel[: kernel.size - kernel.size % 2]].reshape(-1, 2)
    partners = np.full(ours.size, -1, np.int64)
    partners[pairs.max(axis=1)] = pairs.min(axis=1)
    return partners
