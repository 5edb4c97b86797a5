"""Shared machinery of the observers that choose a range from a histogram."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from qtool.observers._reduce import channels_first, reduce_min_max
from qtool.observers.base import Observer, check_range
from qtool.observers.histogram import DEFAULT_BINS, StreamingHistogram
from qtool.observers.minmax import MinMaxObserver


class HistogramObserver(Observer):
    """Keeps a :class:`StreamingHistogram` (one per channel with ``axis``) and the exact min/max.

    Subclasses implement :meth:`_range_1d`, which picks a range from one
    histogram. Non-finite values are counted as zeros; they reach the min/max, so
    the range becomes non-finite and quantization reports it. ``bins`` counts the
    bins on each side of zero.
    """

    concurrent = True

    def __init__(self, axis: int | None = None, bins: int = DEFAULT_BINS) -> None:
        super().__init__(axis)
        StreamingHistogram(bins)  # validates bins before any data arrives
        self.bins = int(bins)
        self.histogram: StreamingHistogram | None = None
        self.extremes = MinMaxObserver(axis)
        # ranges chosen so far, by (bits, symmetric): choosing costs milliseconds per tensor, and the placement
        # choice plans the same tensors for every candidate (cleared whenever the data changes)
        self._chosen: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def options(self) -> dict[str, Any]:
        return {"bins": self.bins}

    def observe(self, batch: np.ndarray) -> None:
        if batch.size == 0:
            return
        self._chosen.clear()
        if self.axis is None:
            if self.histogram is None:
                self.histogram = StreamingHistogram(self.bins)
            lo, hi = self.histogram.add_with_extremes(batch.reshape(-1))
            # + 0.0 turns -0.0 into 0.0: the statistics do not depend on which zero came first
            self.extremes.update_scalar(lo + 0.0, hi + 0.0)
            return
        flat = channels_first(batch, self.axis)
        if self.histogram is None:
            self.histogram = StreamingHistogram(self.bins, flat.shape[0])
        lows, highs = reduce_min_max(batch, self.axis)
        self.extremes.update(lows + 0.0, highs + 0.0)
        if np.all(np.isfinite(lows)) and np.all(np.isfinite(highs)):
            self.histogram.add(flat, peak=max(-float(np.min(lows)), float(np.max(highs))))
        else:  # NaN/Inf reach the extremes (the range becomes non-finite); the histogram counts them as 0
            finite = np.where(np.isfinite(flat), flat, 0.0)
            self.histogram.add(finite)

    def merge(self, other: Observer) -> None:
        self._check_same_kind(other)
        assert isinstance(other, HistogramObserver)
        if other.histogram is None:
            return
        self._chosen.clear()
        if self.histogram is None:
            self.load_state(other.state())
            return
        self.histogram.merge(other.histogram)
        self.extremes.merge(other.extremes)

    def check(self) -> None:
        """The exact extremes' check and one histogram per channel (choosing a range costs seconds: not here)."""
        self.extremes.check()
        if self.axis is not None and self.histogram is not None:
            channels = len(np.atleast_1d(self.extremes.range(8, False)[0]))
            if self.histogram.counts.shape[0] != channels:
                raise ValueError(f"{self.histogram.counts.shape[0]} channel histograms for {channels} channel ranges")

    @property
    def empty(self) -> bool:
        return self.histogram is None  # (the state's histogram as lists would cost a plan's every lookup)

    def state(self) -> dict[str, Any]:
        if self.histogram is None:
            return {}
        return {"histogram": self.histogram.state(), **self.extremes.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self._chosen.clear()
        self.histogram = StreamingHistogram.from_state(state["histogram"])
        self.extremes.load_state(state)

    def observed_range(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self.extremes.observed_range() if self.histogram is not None else None

    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.histogram is None:
            raise ValueError("range() called on an observer that saw no data")
        lo, hi = self.extremes.range(bits, symmetric)
        check_range(lo, hi, self.axis)  # a hand-edited file's extremes: one clear error, not a crash below
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            return lo, hi  # compute_qparams reports the non-finite range with the tensor's name
        key = (int(bits), bool(symmetric))
        if key not in self._chosen:
            self._chosen[key] = self._choose(lo, hi, bits, symmetric)
        low, high = self._chosen[key]
        return low.copy(), high.copy()

    def _choose(self, lo: np.ndarray, hi: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        """The range of each histogram (one, or one per channel) within the exact extremes ``lo``/``hi``."""
        assert self.histogram is not None  # checked by range()
        counts = self.histogram.counts
        width = self.histogram.width
        if self.axis is None:
            low, high = self._range_1d(counts, width, float(lo), float(hi), bits, symmetric)
            return np.asarray(low), np.asarray(high)
        pairs = [
            self._range_1d(counts[c], width, float(lo[c]), float(hi[c]), bits, symmetric) for c in range(len(counts))
        ]
        return np.asarray([p[0] for p in pairs]), np.asarray([p[1] for p in pairs])

    @abstractmethod
    def _range_1d(
        self, counts: np.ndarray, width: float, lo: float, hi: float, bits: int, symmetric: bool
    ) -> tuple[float, float]:
        """Pick (min, max) from one histogram of ``2 * bins`` counts of bin ``width`` centred on zero."""


def magnitude_counts(counts: np.ndarray, bins: int) -> np.ndarray:
    """Counts of |x| in ``bins`` bins from 0 up (the negative half mirrored onto the positive)."""
    return counts[bins:] + counts[:bins][::-1]


def value_at_fraction(counts: np.ndarray, start: float, width: float, fraction: float) -> float:
    """The value below which ``fraction`` of the histogram's mass lies (linear inside a bin)."""
    total = counts.sum()
    if total == 0:
        return start
    cdf = np.cumsum(counts)
    target = fraction * total
    index = int(np.searchsorted(cdf, target, side="left"))
    index = min(index, len(counts) - 1)
    before = cdf[index - 1] if index else 0
    inside = (target - before) / counts[index] if counts[index] else 0.0
    return start + (index + float(np.clip(inside, 0.0, 1.0))) * width
