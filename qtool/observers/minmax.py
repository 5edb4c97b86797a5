"""The min-max observer: the running minimum and maximum of everything seen."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers.base import Observer, register_observer


def _reduce(batch: np.ndarray, axis: int | None, fn: Any) -> np.ndarray:
    if axis is None:
        return np.asarray(fn(batch), dtype=np.float64)
    axes = tuple(i for i in range(batch.ndim) if i != axis % batch.ndim)
    return np.asarray(fn(batch, axis=axes), dtype=np.float64)


@register_observer
class MinMaxObserver(Observer):
    """Tracks the exact minimum and maximum; the range is those two values.

    Exact and cheap, but one outlier stretches the range for every value.
    """

    name = "minmax"

    def __init__(self, axis: int | None = None) -> None:
        super().__init__(axis)
        self.min: np.ndarray | None = None
        self.max: np.ndarray | None = None

    def observe(self, batch: np.ndarray) -> None:
        if batch.size == 0:
            return
        lo, hi = _reduce(batch, self.axis, np.min), _reduce(batch, self.axis, np.max)
        self.min = lo if self.min is None else np.minimum(self.min, lo)
        self.max = hi if self.max is None else np.maximum(self.max, hi)

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

    @classmethod
    def from_state(cls, state: dict[str, Any], axis: int | None = None) -> MinMaxObserver:
        observer = cls(axis)
        if state:
            observer.min = np.asarray(state["min"], dtype=np.float64)
            observer.max = np.asarray(state["max"], dtype=np.float64)
        return observer

    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.min is None or self.max is None:
            raise ValueError("range() called on an observer that saw no data")
        return self.min, self.max
