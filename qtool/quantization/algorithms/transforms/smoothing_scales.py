"""SmoothQuant's numbers: channel ranges, the outlier ratio and the per-channel scales (pure numpy)."""

from __future__ import annotations

import math

import numpy as np

from qtool.errors import QtoolError

# max/median of the channel abs maxima. At ratio r the typical channel uses about 1/r of the uint8
# grid, i.e. loses log2(r) bits: below 5 (2.3 bits lost, about 50 levels left) per-tensor
# quantization is already fair, and smoothing would trade weight precision, and often an extra Mul
# at run time, for little. The LLM outliers SmoothQuant targets are 20-100x the median.
DEFAULT_MIN_OUTLIER_RATIO = 5.0
SCALE_MIN, SCALE_MAX = 1e-5, 1e5


def channel_absmax(batch: np.ndarray) -> np.ndarray:
    """Per-channel (last axis) abs max of one batch, float32; merge batches with ``np.maximum``."""
    values = np.asarray(batch)
    if values.ndim == 0:
        raise QtoolError("an activation batch is a scalar", hint="pass the tensor's values, channels last")
    if values.size == 0:
        return np.zeros(values.shape[-1], np.float32)
    return np.abs(values.reshape(-1, values.shape[-1])).max(axis=0).astype(np.float32)


def outlier_ratio(act_absmax: np.ndarray) -> float:
    """``max(a) / median(a)`` over the finite channels; inf when most channels are zero, 0 when all are."""
    a = np.asarray(act_absmax, np.float64).reshape(-1)
    a = a[np.isfinite(a)]
    if a.size == 0 or a.max() <= 0:
        return 0.0
    median = float(np.median(a))
    return math.inf if median <= 0 else float(a.max() / median)


def smoothing_scales(act_absmax: np.ndarray, weight_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """``s = a^alpha / w^(1 - alpha)`` per channel, float32.

    A channel with a zero or non-finite ``a`` or ``w`` gets 1; the rest are clamped to
    [:data:`SCALE_MIN`, :data:`SCALE_MAX`] so that neither side can overflow or underflow.

    Args:
        act_absmax: the activation's abs max per input channel [K].
        weight_absmax: the weight's abs max per input channel (row of ``W [K, N]``) [K].
        alpha: migration strength in [0, 1]: 0 leaves the activation as it is (up to the weight's
            row range), 1 moves all of its range into the weight.

    Raises:
        QtoolError: an alpha outside [0, 1] or shapes that differ.
    """
    check_alpha(alpha, "smoothing_scales")
    a = np.asarray(act_absmax, np.float64)
    w = np.asarray(weight_absmax, np.float64)
    if a.shape != w.shape or a.ndim != 1:
        raise QtoolError(
            f"activation abs max of shape {a.shape} does not match weight abs max of shape {w.shape}",
            hint="both must hold one value per input channel of the weight",
        )
    with np.errstate(all="ignore"):
        s = a**alpha / w ** (1.0 - alpha)
    valid = np.isfinite(a) & np.isfinite(w) & (a > 0) & (w > 0) & np.isfinite(s) & (s > 0)
    return np.clip(np.where(valid, s, 1.0), SCALE_MIN, SCALE_MAX).astype(np.float32)


def check_alpha(alpha: float, where: str) -> None:
    """Refuse a migration strength outside [0, 1], naming ``where`` it was given."""
    if not 0.0 <= alpha <= 1.0:
        raise QtoolError(f"{where}: SmoothQuant alpha {alpha} is outside [0, 1]", hint="use a value such as 0.5")


def absmax_along(weight: np.ndarray, axis: int) -> np.ndarray:
    """Abs max over every axis but ``axis``."""
    others = tuple(i for i in range(weight.ndim) if i != axis % weight.ndim)
    return np.abs(weight.astype(np.float64)).max(axis=others)


def along(s: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """``s`` shaped to broadcast along ``axis`` of a rank-``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = s.size
    return np.asarray(s, np.float64).reshape(shape)
