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
from qtool.quantization.qparams import QParams

log = logging.getLogger(__name__)

WeightKind = Literal["Conv", "MatMul", "Gemm"]
DAMP_RETRIES = 3  # damping x10 this many times when the Cholesky factorisation fails


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


def gptq_round(
    weight_rows: np.ndarray,
    hessian: np.ndarray,
    scale: np.ndarray | float,
    zero_point: np.ndarray | int,
    qmin: int,
    qmax: int,
    *,
    damp: float = 0.01,
    block: int = 128,
    block_size: int | None = None,
) -> GptqResult:
    """Integer codes for ``weight_rows`` that minimise the output error on inputs with ``hessian``.

    Args:
        weight_rows: the float weight as [rows, K] (see :func:`weight_rows`).
        hessian: ``E[x x^T]`` as [K, K], or [groups, K, K] for grouped Conv (rows split evenly).
        scale: float32 scale: a scalar, per row [rows], per element [rows, K] or, with
            ``block_size``, per block of K [rows, ceil(K / block_size)].
        zero_point: the zero point, shaped like ``scale``.
        qmin: the smallest code (``QParams.qmin``, which honours a narrow range).
        qmax: the largest code.
        damp: added to H's diagonal as a fraction of its mean, for a stable inverse.
        block: columns updated together (speed only; the result does not depend on it).
        block_size: the block length along K of a per-block scale.

    Returns:
        The codes, on the same grid as nearest rounding with this scale and zero point.
    """
    w = np.asarray(weight_rows, np.float32)
    rows, k = w.shape
    h = np.asarray(hessian, np.float64)
    h = h[None] if h.ndim == 2 else h
    groups = h.shape[0]
    if h.shape[1:] != (k, k) or rows % groups:
        raise QtoolError(
            f"a Hessian of shape {np.shape(hessian)} does not fit a weight of {rows} rows x {k} columns",
            hint="the input statistics were collected for another node",
        )
    scale_full = _per_column(np.asarray(scale, np.float32), rows, k, block_size)
    zero_full = _per_column(np.asarray(zero_point, np.int64), rows, k, block_size)
    codes = round_nearest(w, scale_full, zero_full, qmin, qmax)
    per_group = rows // groups
    used_damp, nearest, dead_total = damp, 0, 0
    for g in range(groups):
        part = slice(g * per_group, (g + 1) * per_group)
        live = np.diag(h[g]) > 0
        dead_total += int((~live).sum()) * per_group
        if not live.any():
            continue
        factor, group_damp = _inverse_factor(h[g][np.ix_(live, live)], damp)
        if factor is None:
            nearest += 1
            continue
        used_damp = max(used_damp, group_damp)
        codes[part, live] = _gptq_columns(
            w[part][:, live], factor, scale_full[part][:, live], zero_full[part][:, live], qmin, qmax, block
        )
    if nearest:
        log.warning("GPTQ: %d of %d weight groups have a singular Hessian; they use nearest rounding", nearest, groups)
    return GptqResult(codes, used_damp, nearest, dead_total)


def _inverse_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray | None, float]:
    """The upper Cholesky factor of the damped ``H^-1``, retrying with 10x damping; None if it never works."""
    mean_diag = float(np.mean(np.diag(h)))
    for attempt in range(DAMP_RETRIES + 1):
        relative = damp * 10**attempt
        damped = h + np.eye(len(h)) * relative * mean_diag
        try:
            lower = np.linalg.cholesky(damped)
            inverse_lower = np.linalg.inv(lower)
            inverse = inverse_lower.T @ inverse_lower
            upper = np.linalg.cholesky(inverse).T
        except np.linalg.LinAlgError:
            continue
        if np.all(np.isfinite(upper)):
            return upper, relative
    return None, damp * 10**DAMP_RETRIES


def _gptq_columns(
    w: np.ndarray, upper: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin: int, qmax: int, block: int
) -> np.ndarray:
    """The GPTQ loop on live columns: [rows, K] floats -> [rows, K] codes."""
    work = w.astype(np.float64)
    k = work.shape[1]
    codes = np.empty(work.shape, np.int64)
    for start in range(0, k, block):
        stop = min(start + block, k)
        chunk = work[:, start:stop].copy()
        errors = np.zeros_like(chunk)
        u = upper[start:stop, start:stop]
        for i in range(stop - start):
            column = start + i
            q = round_nearest(
                chunk[:, i : i + 1], scale[:, column : column + 1], zero[:, column : column + 1], qmin, qmax
            )
            codes[:, column] = q[:, 0]
            dequantized = ((q[:, 0] - zero[:, column]).astype(np.float32) * scale[:, column]).astype(np.float64)
            error = (chunk[:, i] - dequantized) / u[i, i]
            chunk[:, i:] -= np.outer(error, u[i, i:])
            errors[:, i] = error
        work[:, stop:] -= errors @ upper[start:stop, stop:]
    return codes
