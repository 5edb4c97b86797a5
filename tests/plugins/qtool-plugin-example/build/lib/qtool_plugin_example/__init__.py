"""An example observer plugin: the largest magnitude seen, times a safety margin."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers import Observer


class AbsMaxMarginObserver(Observer):
    """Symmetric range +/- margin * max|x| (margin default 1.0)."""

    name = "absmax_margin"

    def __init__(self, axis: int | None = None, margin: float = 1.0) -> None:
        super().__init__(axis)
        self.margin = float(margin)
        self.absmax: float | None = None

    def options(self) -> dict[str, Any]:
        return {"margin": self.margin}

    def observe(self, batch: np.ndarray) -> None:
        peak = float(np.max(np.abs(batch)))
        self.absmax = peak if self.absmax is None else max(self.absmax, peak)

    def merge(self, other: Observer) -> None:
        self._check_same_kind(other)
        assert isinstance(other, AbsMaxMarginObserver)
        if other.absmax is not None:
            self.absmax = other.absmax if self.absmax is None else max(self.absmax, other.absmax)

    def state(self) -> dict[str, Any]:
        return {} if self.absmax is None else {"absmax": self.absmax}

    def load_state(self, state: dict[str, Any]) -> None:
        self.absmax = float(state["absmax"])

    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        assert self.absmax is not None
        return np.asarray(-self.absmax * self.margin), np.asarray(self.absmax * self.margin)
