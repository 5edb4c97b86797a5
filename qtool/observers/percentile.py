"""The percentile observer: clip the range at a percentile of the streaming histogram."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers._histogram_base import HistogramObserver, magnitude_counts, value_at_fraction
from qtool.observers.base import register_observer
from qtool.observers.histogram import DEFAULT_BINS


@register_observer
class PercentileObserver(HistogramObserver):
    """Clips at a percentile of the values (default 99.99), from a streaming histogram.

    Symmetric: the percentile of |x|. Asymmetric: the (100 - p)-th and p-th
    percentiles. Never wider than the observed min/max.
    """

    name = "percentile"

    def __init__(self, axis: int | None = None, percentile: float = 99.99, bins: int = DEFAULT_BINS) -> None:
        super().__init__(axis, bins)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = float(percentile)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "percentile": self.percentile}

    def _range_1d(
        self, counts: np.ndarray, width: float, lo: float, hi: float, bits: int, symmetric: bool
    ) -> tuple[float, float]:
        fraction = self.percentile / 100.0
        if symmetric:
            threshold = value_at_fraction(magnitude_counts(counts, self.bins), 0.0, width, fraction)
            return max(lo, -threshold), min(hi, threshold)
        start = -self.bins * width
        low = value_at_fraction(counts, start, width, 1.0 - fraction)
        high = value_at_fraction(counts, start, width, fraction)
        return max(lo, low), min(hi, high)
