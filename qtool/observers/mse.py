"""The MSE observer: the clipping range that minimises the expected quantization error."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers._histogram_base import HistogramObserver
from qtool.observers.base import register_observer
from qtool.observers.histogram import DEFAULT_BINS
from qtool.quantization.numerics.qparams import QuantType, compute_qparams


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
        fractions = np.linspace(self.min_fraction, 1.0, self.candidates)
        if symmetric:
            absmax = max(-lo, hi)
            lows, highs = -fractions * absmax, fractions * absmax
        else:
            lows, highs = fractions * min(lo, 0.0), fractions * max(hi, 0.0)
        qtype = _grid_type(bits, symmetric)
        qp = compute_qparams(lows, highs, qtype, symmetric=symmetric)
        scale, zero = qp.scale.astype(np.float64)[:, None], qp.zero_point.astype(np.float64)[:, None]
        q = np.clip(np.rint(centres[None, :] / scale) + zero, qtype.qmin, qtype.qmax)
        errors = (((q - zero) * scale - centres[None, :]) ** 2 * weights[None, :]).sum(axis=1)
        best = int(np.argmin(errors))
        return (max(lo, float(lows[best])), min(hi, float(highs[best])))
