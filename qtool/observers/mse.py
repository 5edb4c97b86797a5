"""The MSE observer: the clipping range that minimises the expected quantization error."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.numerics.qparams import QuantType
from qtool.numerics.ranges import least_error_range
from qtool.observers._histogram_base import HistogramObserver
from qtool.observers.base import register_observer
from qtool.observers.histogram import DEFAULT_BINS


def _grid_type(bits: int, symmetric: bool) -> QuantType:
    if symmetric:
        return QuantType(f"int{bits}", 0, np.int32, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return QuantType(f"uint{bits}", 0, np.int32, 0, 2**bits - 1)


@register_observer
class MseObserver(HistogramObserver):
    """Clipping range with the least expected quantization MSE for the target bit width.

    Tries ``candidates`` (default 100) ranges shrunk from the observed min/max
    (``fraction`` x range, fraction in [min_fraction, 1]) and scores each by
    quantizing every histogram bin centre with the qparams that range would get
    for the target bit width, weighted by the bin's count.
    """

    name = "mse"

    def __init__(
        self, axis: int | None = None, bins: int = DEFAULT_BINS, candidates: int = 100, min_fraction: float = 0.05
    ) -> None:
        super().__init__(axis, bins)
        if not 2 <= candidates <= 10_000 or not 0.0 < min_fraction < 1.0:
            raise ValueError("need 2 <= candidates <= 10000 and 0 < min_fraction < 1")
        self.candidates = int(candidates)
        self.min_fraction = float(min_fraction)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "candidates": self.candidates, "min_fraction": self.min_fraction}

    def _range_1d(
        self, counts: np.ndarray, width: float, lo: float, hi: float, bits: int, symmetric: bool
    ) -> tuple[float, float]:
        occupied = np.flatnonzero(counts)
        if len(occupied) == 0 or hi == lo:
            return lo, hi
        centres = (occupied - self.bins + 0.5) * width
        centres = np.clip(centres, lo, hi)
        weights = counts[occupied].astype(np.float64)
        fractions = np.linspace(self.min_fraction, 1.0, self.candidates)[:, None]
        if symmetric:
            absmax = max(-lo, hi)
            lows, highs = -fractions * absmax, fractions * absmax
        else:
            lows, highs = fractions * min(lo, 0.0), fractions * max(hi, 0.0)
        best = least_error_range(
            centres[None, :],
            lows,
            highs,
            _grid_type(bits, symmetric),
            symmetric=symmetric,
            narrow_range=False,
            counts=weights,
        )
        return (max(lo, float(best[0][0])), min(hi, float(best[1][0])))
