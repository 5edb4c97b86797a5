"""The mean-std observer: mean +/- k standard deviations, clipped to what was seen."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers._reduce import channels_first, reduce_min_max
from qtool.observers.base import Observer, register_observer


@register_observer
class MeanStdObserver(Observer):
    """Mean +/- k standard deviations, never wider than the observed min/max.

    Keeps exact sums (count, sum, sum of squares in float64), so shards merge
    exactly. Suits bell-shaped activations; clips heavy tails.
    """

    name = "mean_std"

    def __init__(self, axis: int | None = None, k: float = 3.0) -> None:
        super().__init__(axis)
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        self.k = float(k)
        self.count = 0
        self.sum: np.ndarray | None = None
        self.sum_sq: np.ndarray | None = None
        self.min: np.ndarray | None = None
        self.max: np.ndarray | None = None

    def options(self) -> dict[str, Any]:
        return {"k": self.k}

    def observe(self, batch: np.ndarray) -> None:
        if batch.size == 0:
            return
        flat = channels_first(batch, self.axis).astype(np.float64)
        total, total_sq = flat.sum(axis=-1), np.einsum("...i,...i->...", flat, flat)
        lo, hi = reduce_min_max(batch, self.axis)
        if self.sum is None or self.sum_sq is None or self.min is None or self.max is None:
            self.sum, self.sum_sq, self.min, self.max = total, total_sq, lo, hi
        else:
            self.sum, self.sum_sq = self.sum + total, self.sum_sq + total_sq
            self.min, self.max = np.minimum(self.min, lo), np.maximum(self.max, hi)
        self.count += flat.shape[-1]

    def merge(self, other: Observer) -> None:
        self._check_same_kind(other)
        assert isinstance(other, MeanStdObserver)
        if other.sum is None:
            return
        if self.sum is None:
            self.load_state(other.state())
            return
        assert self.sum_sq is not None and other.sum_sq is not None  # set together with sum
        assert self.min is not None and self.max is not None and other.min is not None and other.max is not None
        self.sum, self.sum_sq = self.sum + other.sum, self.sum_sq + other.sum_sq
        self.min = np.minimum(self.min, other.min)
        self.max = np.maximum(self.max, other.max)
        self.count += other.count

    def state(self) -> dict[str, Any]:
        if self.sum is None or self.sum_sq is None or self.min is None or self.max is None:
            return {}
        return {
            "count": self.count,
            "sum": self.sum.tolist(),
            "sum_sq": self.sum_sq.tolist(),
            "min": self.min.tolist(),
            "max": self.max.tolist(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        if self.count < 1:
            raise ValueError(f"a mean/std over {self.count} values has no value")
        self.sum = np.asarray(state["sum"], dtype=np.float64)
        self.sum_sq = np.asarray(state["sum_sq"], dtype=np.float64)
        self.min = np.asarray(state["min"], dtype=np.float64)
        self.max = np.asarray(state["max"], dtype=np.float64)

    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.sum is None or self.sum_sq is None or self.min is None or self.max is None:
            raise ValueError("range() called on an observer that saw no data")
        mean = self.sum / self.count
        std = np.sqrt(np.maximum(self.sum_sq / self.count - mean * mean, 0.0))
        return np.maximum(mean - self.k * std, self.min), np.minimum(mean + self.k * std, self.max)
