"""Choosing a weight's range, and the MSE clipping search.

:func:`least_error_range` picks, of candidate ranges, the one whose grid reconstructs the values best:
one search for both its users, low-bit weights (:func:`mse_weight_range`, per group of a weight) and the
``mse`` observer (over its histogram's bin centres, weighted by their counts).
"""

from __future__ import annotations

import numpy as np

from qtool.numerics.qparams import (
    CHUNK_ELEMENTS,
    QParams,
    QuantType,
    compute_qparams,
    quant_type,
    weight_range,
)
from qtool.schemes import TensorScheme


def _grouped(weight: np.ndarray, axis: int | None, block_size: int | None) -> tuple[np.ndarray, tuple[int, ...]]:
    """``weight`` as (groups, elements): one row per scale; plus the shape the per-group values take."""
    w = weight.astype(np.float32, copy=False)  # only read: the reshapes below copy where they must
    if axis is None:
        return w.reshape(1, -1), ()
    moved = np.moveaxis(w, axis, -1)
    if block_size is None:
        moved = np.moveaxis(w, axis, 0)
        return moved.reshape(moved.shape[0], -1), (moved.shape[0],)
    pad = (-moved.shape[-1]) % block_size
    if pad:  # zeros are exactly representable, so padding a short last block changes no error
        moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], pad), np.float32)], axis=-1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size)
    return blocks.reshape(-1, block_size), blocks.shape[:-1]


def mse_weight_range(
    weight: np.ndarray,
    qtype: QuantType,
    *,
    symmetric: bool,
    axis: int | None,
    block_size: int | None = None,
    candidates: int = 40,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-group clipping range that minimises the weight's quantization MSE.

    Low-bit weights lose most of their precision to the few largest values when
    the range is simply min..max; shrinking it (fractions 1/candidates .. 1 of the
    min/max) trades clipping those for finer steps everywhere else. The result has
    the same shapes as :func:`weight_range`.
    """
    groups, shape = _grouped(weight, axis, block_size)
    rows = max(1, CHUNK_ELEMENTS // max(1, groups.shape[1]))  # groups are independent: a chunk of them at a time
    ranges = [
        _mse_range(groups[start : start + rows], qtype, symmetric, candidates) for start in range(0, len(groups), rows)
    ]
    best_lo = np.concatenate([lo for lo, _ in ranges]) if ranges else np.zeros(0)
    best_hi = np.concatenate([hi for _, hi in ranges]) if ranges else np.zeros(0)
    if axis is not None and block_size is not None:
        best_lo = np.moveaxis(best_lo.reshape(shape), -1, axis)
        best_hi = np.moveaxis(best_hi.reshape(shape), -1, axis)
    else:
        best_lo, best_hi = best_lo.reshape(shape), best_hi.reshape(shape)
    return best_lo, best_hi


def _mse_range(groups: np.ndarray, qtype: QuantType, symmetric: bool, candidates: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`mse_weight_range` of the rows of ``groups`` [groups, elements]."""
    lo_all, hi_all = groups.min(axis=1).astype(np.float64), groups.max(axis=1).astype(np.float64)
    fractions = np.linspace(1.0 / candidates, 1.0, candidates)[:, None]
    return least_error_range(groups, fractions * lo_all, fractions * hi_all, qtype, symmetric=symmetric)


def least_error_range(
    values: np.ndarray,
    lows: np.ndarray,
    highs: np.ndarray,
    qtype: QuantType,
    *,
    symmetric: bool,
    narrow_range: bool | None = None,
    counts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Of candidate clipping ranges, per group the one whose grid reconstructs ``values`` with the least error.

    The MSE clipping search of weights (:func:`mse_weight_range`) and of the ``mse`` observer (over
    its histogram's bin centres, ``counts`` weighting each) alike.

    Args:
        values: [groups, elements], computed in their own dtype (float32 weights, float64 bin centres).
        lows: [candidates, groups] candidate minimums.
        highs: [candidates, groups] candidate maximums.
        qtype: the grid's type.
        symmetric: zero-centred grids.
        narrow_range: signed symmetric grids without their most negative value (default: ``symmetric``).
        counts: [elements] weights of the squared errors (None: 1 each).

    Returns:
        Per group, the first candidate with the least squared error (the last, the widest, when none is finite).
    """
    narrow = symmetric if narrow_range is None else narrow_range
    qmin = -qtype.qmax if narrow and symmetric and qtype.signed else qtype.qmin
    if len(values) == 1:  # one group (an observer's histogram): every candidate at once
        return _least_error_of_one(values, lows, highs, qtype, symmetric, narrow, qmin, counts)
    best_err = np.full(len(values), np.inf)
    best_lo, best_hi = lows[-1].copy(), highs[-1].copy()
    for lo, hi in zip(lows, highs, strict=True):
        qp = compute_qparams(lo, hi, qtype, symmetric=symmetric, narrow_range=narrow)
        scale = qp.scale.astype(values.dtype)[:, None]
        zero = qp.zero_point.astype(values.dtype)[:, None]
        q = np.clip(np.rint(values / scale) + zero, qmin, qtype.qmax)
        squared = ((q - zero) * scale - values) ** 2
        err = (squared if counts is None else squared * counts).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_lo, best_hi = np.where(better, lo, best_lo), np.where(better, hi, best_hi)
    return best_lo, best_hi


def weight_qparams(
    weight: np.ndarray,
    scheme: TensorScheme,
    axis: int | None,
    what: str,
    block_size: int | None = None,
    *,
    reduce_range: bool = False,
) -> QParams:
    """Scale / zero point of a weight from its own values (symmetric weights use the narrow range).

    8-bit weights use their min/max; 4- and 2-bit weights the MSE-optimal clipping range.
    ``reduce_range`` halves the integer range (see :meth:`QuantType.reduced_range`).
    """
    qtype = quant_type(scheme.dtype)
    if reduce_range:
        qtype = qtype.reduced_range()
    if qtype.bits <= 4:
        lo, hi = mse_weight_range(weight, qtype, symmetric=scheme.symmetric, axis=axis, block_size=block_size)
    else:
        lo, hi = weight_range(weight, axis, block_size)
    qp = compute_qparams(
        lo,
        hi,
        qtype,
        symmetric=scheme.symmetric,
        narrow_range=scheme.symmetric,
        axis=axis,
        what=what,
    )
    return QParams(qp.scale, qp.zero_point, qp.qtype, axis, block_size, qp.narrow)


def _least_error_of_one(
    values: np.ndarray,
    lows: np.ndarray,
    highs: np.ndarray,
    qtype: QuantType,
    symmetric: bool,
    narrow: bool,
    qmin: int,
    counts: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`least_error_range` of a single group, its candidates scored a block at a time (the same sums)."""
    lo_all, hi_all = lows[:, 0], highs[:, 0]
    errors = np.empty(len(lo_all))
    step = max(1, CHUNK_ELEMENTS // max(1, values.shape[1]))
    for start in range(0, len(lo_all), step):
        qp = compute_qparams(
            lo_all[start : start + step], hi_all[start : start + step], qtype, symmetric=symmetric, narrow_range=narrow
        )
        scale = qp.scale.astype(values.dtype)[:, None]
        zero = qp.zero_point.astype(values.dtype)[:, None]
        q = np.clip(np.rint(values / scale) + zero, qmin, qtype.qmax)
        squared = ((q - zero) * scale - values) ** 2
        errors[start : start + step] = (squared if counts is None else squared * counts).sum(axis=1)
    finite = np.where(np.isnan(errors), np.inf, errors)
    best = int(np.argmin(finite)) if np.isfinite(finite).any() else len(errors) - 1
    return lows[best].copy(), highs[best].copy()
