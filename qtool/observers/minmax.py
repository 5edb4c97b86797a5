"""Min-max observers: the exact running extremes, and their exponential moving average."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers._reduce import reduce_min_max
from qtool.observers.base import Observer, register_observer


@register_observer
class MinMaxObserver(Observer):
    """Exact running minimum and maximum; one outlier stretches the range for every value."""

    name = "minmax"

    def __init__(self, axis: int | None = None) -> None:
        super().__init__(axis)
        self.min: np.ndarray | None = None
        self.max: np.ndarray | None = None

    def observe(self, batch: np.ndarray) -> None:
        if batch.size == 0:
            return
        if self.axis is None:  # the common case, without the per-channel machinery's numpy calls
            flat = batch.reshape(-1)
            self.update_scalar(float(flat.min()), float(flat.max()))
            return
        self.update(*reduce_min_max(batch, self.axis))

    def update(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Fold in a batch's already computed extremes."""
        self.min = lo if self.min is None else np.minimum(self.min, lo)
        self.max = hi if self.max is None else np.maximum(self.max, hi)

    def update_scalar(self, lo: float, hi: float) -> None:
        """:meth:`update` for a tensor-wide (min, max), with numpy calls only when the extremes move.

        Exactly ``np.minimum(current, lo)`` and ``np.maximum(current, hi)``: NaN wins and stays, and a
        tie takes the new value (which decides the sign of a zero extreme).
        """
        if self.min is None or self.max is None:
            self.min, self.max = np.asarray(lo), np.asarray(hi)
            return
        low, high = float(self.min), float(self.max)
        if low == low and not low < lo:
            self.min = np.asarray(lo)
        if high == high and not high > hi:
            self.max = np.asarray(hi)

    def merge(self, other: Observer) -> None:
        self._check_same_kind(other)
        assert isinstance(other, MinMaxObserver)  # narrowed by _check_same_kind
        if other.min is None or other.max is None:
            return
        self.min = other.min.copy() if self.min is None else np.minimum(self.min, other.min)
        self.max = other.max.copy() if self.max is None else np.maximum(self.max, other.max)

    def state(self) -> dict[str, Any]:
        if self.min is None or self.max is None:
            return {}
        return {"min": self.min.tolist(), "max": self.max.tolist()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.min = np.asarray(state["min"], dtype=np.float64)
        self.max = np.asarray(state["max"], dtype=np.float64)

    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.min is None or self.max is None:
            raise ValueError("range() called on an observer that saw no data")
        return self.min, self.max

    def observed_range(self) -> tuple[np.ndarray, np.ndarray] | None:
        return None if self.min is None or self.max is None else (self.min, self.max)


@register_observer
class MovingAverageObserver(Observer):
    """Exponential moving average of each batch's min and max.

    With averaging constant c (default 0.01):
    ``range = (1 - c) * range + c * batch_range`` after the first batch, which
    sets it. Damps batches with outliers; depends on batch order and size, so
    merging two shards weights their averages by the number of batches each saw
    (an approximation, unlike the histogram observers' exact merge).
    """

    name = "moving_average"

    def __init__(self, axis: int | None = None, averaging_constant: float = 0.01) -> None:
        super().__init__(axis)
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant}")
        self.averaging_constant = float(averaging_constant)
        self.min: np.ndarray | None = None
        self.max: np.ndarray | None = None
        self.batches = 0

    def options(self) -> dict[str, Any]:
        return {"averaging_constant": self.averaging_constant}

    def observe(self, batch: np.ndarray) -> None:
        if batch.size == 0:
            return
        lo, hi = reduce_min_max(batch, self.axis)
        if self.min is None or self.max is None:
            self.min, self.max = lo, hi
        else:
            c = self.averaging_constant
            self.min = self.min + c * (lo - self.min)
            self.max = self.max + c * (hi - self.max)
        self.batches += 1

    def merge(self, other: Observer) -> None:
        self._check_same_kind(other)
        assert isinstance(other, MovingAverageObserver)
        if other.min is None or other.max is None:
            return
        if self.min is None or self.max is None:
            self.min, self.max, self.batches = other.min.copy(), other.max.copy(), other.batches
            return
        total = self.batches + other.batches
        if total <= 0:
            raise ValueError("a moving average of 0 batches has no value")
        self.min = (self.min * self.batches + other.min * other.batches) / total
        self.max = (self.max * self.batches + other.max * other.batches) / total
        self.batches = total

    def state(self) -> dict[str, Any]:
        if self.min is None or self.max is None:
            return {}
        return {"min": self.min.tolist(), "max": self.max.tolist(), "batches": self.batches}

    def load_state(self, state: dict[str, Any]) -> None:
        self.min = np.asarray(state["min"], dtype=np.float64)
        self.max = np.asarray(state["max"], dtype=np.float64)
        self.batches = int(state["batches"])
        if self.batches < 1:
            raise ValueError(f"a moving average of {self.batches} batches has no value")

    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.min is None or self.max is None:
            raise ValueError("range() called on an observer that saw no data")
        return self.min, self.max
