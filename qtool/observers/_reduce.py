"""Per-tensor / per-channel reductions shared by the observers."""

from __future__ import annotations

import numpy as np


def channels_first(batch: np.ndarray, axis: int | None) -> np.ndarray:
    """View ``batch`` as ``(n,)`` (per-tensor) or ``(channels, n)`` (per-channel along ``axis``)."""
    if axis is None:
        return batch.reshape(-1)
    moved = np.moveaxis(batch, axis % batch.ndim, 0)
    return moved.reshape(moved.shape[0], -1)


def reduce_min_max(batch: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Minimum and maximum over everything, or per channel along ``axis`` (as float64)."""
    flat = channels_first(batch, axis)
    return (np.asarray(flat.min(axis=-1), dtype=np.float64), np.asarray(flat.max(axis=-1), dtype=np.float64))
