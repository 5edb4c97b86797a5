"""A streaming histogram that grows its range without losing counts and merges exactly.

The histogram covers ``[-R, R]`` with ``2 * bins`` bins of width ``w = R / bins``,
where ``R`` is always a power of two. A value ``x`` falls in bin
``floor(x / w) + bins``; since ``w`` is a power of two that division is exact.
When a batch reaches past ``R``, the range doubles and every pair of adjacent
bins folds into one: ``floor(floor(x / w) / 2) == floor(x / (2 w))``, so the
counts are exactly what binning everything at the final resolution would give.
Two histograms merge exactly by doubling the smaller range until both agree.
That is what lets calibration shards run on different machines and still
produce the single-run statistics.

With ``axis`` set, one histogram per channel is kept in a 2-D array.

Counting is the observers' whole cost: a compiled kernel (``_counting.c``) reads each float32
value once for its bin and the batch's extremes; numpy, where the kernel is not built, needs
several passes. Both give the same counts (tests/observers/test_histogram.py checks it).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

try:
    from qtool.observers import _counting
except ImportError:  # installed without a C compiler: numpy counts, exactly as the kernel would
    _counting = None  # type: ignore[assignment]

_FLOAT32 = np.dtype(np.float32)  # the kernel's dtype (compared by identity: a native float32 array's dtype is it)

DEFAULT_BINS = 2048
MAX_BINS = 1 << 20  # 16 MiB of counts per histogram: more says nothing more about a range


_SCRATCH = threading.local()  # the kernel's sub-histograms: one zeroed buffer per thread, reused


def _scratch(bins: int) -> np.ndarray:
    """The calling thread's zeroed uint32 scratch for the kernel (it hands the buffer back zeroed)."""
    found: dict[int, np.ndarray] = _SCRATCH.__dict__.setdefault("buffers", {})
    if bins not in found:
        found[bins] = np.zeros(4 * (2 * bins + 16), np.uint32)
    return found[bins]


def counting_kernel() -> bool:
    """Whether the compiled counting kernel is built (pip builds it where a C compiler is found)."""
    return _counting is not None


def _pow2_above(value: float) -> float:
    """Smallest power of two strictly greater than value (value > 0), so |x| < R for every x seen."""
    return math.ldexp(1.0, math.frexp(value)[1])  # value = m * 2**e with 0.5 <= m < 1, so 2**e > value


MAX_CHANNELS = 1 << 16  # channels of one per-channel histogram (a tensor axis)


class StreamingHistogram:
    """Counts of values in ``2 * bins`` equal bins over ``[-R, R]``, R a power of two.

    Args:
        bins: bins per side of zero (a power of two, >= 8).
        channels: ``None`` for one histogram, or the number of channels.
    """

    def __init__(self, bins: int = DEFAULT_BINS, channels: int | None = None) -> None:
        if bins < 8 or bins & (bins - 1) or bins > MAX_BINS:
            raise ValueError(f"histogram bins must be a power of two from 8 to {MAX_BINS}, got {bins}")
        self.bins = bins
        self.channels = channels
        self.radius = 0.0  # R; 0 until a non-zero value is seen
        shape = (2 * bins,) if channels is None else (channels, 2 * bins)
        self.counts = np.zeros(shape, dtype=np.int64)

    @property
    def width(self) -> float:
        return self.radius / self.bins

    def _grow_to(self, radius: float) -> None:
        """Double the range until it reaches ``radius``, folding bin pairs."""
        if self.radius == 0.0:
            self.radius = radius
            return
        while self.radius < radius:
            pairs = self.counts.reshape(*self.counts.shape[:-1], self.bins, 2).sum(axis=-1)
            grown = np.zeros_like(self.counts)
            grown[..., self.bins // 2 : self.bins // 2 + self.bins] = pairs
            self.counts = grown
            self.radius *= 2

    def add(self, values: np.ndarray, peak: float | None = None) -> None:
        """Count finite ``values``: a flat array, or ``(channels, n)`` when per-channel.

        ``peak`` (max |x|, if the caller already knows it) saves a pass over the data.
        """
        if values.size == 0:
            return
        if peak is None:
            peak = float(max(-np.min(values), np.max(values)))
        if peak > 0:
            self._grow_to(_pow2_above(peak))
        total = 2 * self.bins
        rows = 1 if self.channels is None else self.channels
        if self.radius == 0.0:
            # Everything so far is exactly zero: count it in the bin just above zero.
            self.counts.reshape(rows, total)[:, self.bins] += values.size // rows
            return
        # x / w is exact (w is a power of two), so float32 suffices; -R < x < R keeps the
        # index in [0, 2 * bins).
        inverse = 1.0 / self.width
        # float32 is exact and fast while 1/w stays well inside its range; tiny radii need float64.
        dtype = np.float32 if 2.0**-100 < inverse < 2.0**100 else np.float64
        scaled = np.multiply(values, dtype(inverse), dtype=dtype)
        np.floor(scaled, out=scaled)
        if inverse < 1.0:
            # Scaling down, a tiny negative value can underflow to -0.0 and floor to bin 0 instead
            # of -1: it would land on the other side of zero than in a histogram of another radius.
            underflow = scaled == 0
            if underflow.any():
                scaled[underflow & (values < 0)] = -1.0
        np.add(scaled, self.bins, out=scaled)  # whole numbers below 2**22: exact in float32
        index = scaled.astype(np.intp)
        if self.channels is not None:
            index += (np.arange(self.channels, dtype=np.intp) * total)[:, None]
        found = np.bincount(index.ravel(), minlength=rows * total)
        self.counts += found.reshape(self.counts.shape)

    def add_with_extremes(self, values: np.ndarray) -> tuple[float, float]:
        """Count a flat batch (one histogram) and return its min and max.

        NaN and +-inf reach the extremes and are counted as zeros (the range is unusable anyway).
        With the compiled kernel a float32 batch is read once (twice when the range grows).
        """
        if self.channels is not None:
            raise ValueError("add_with_extremes counts one histogram; per-channel batches go through add()")
        if _counting is not None and values.dtype is _FLOAT32 and values.size:
            scratch = _scratch(self.bins)
            try:
                lo, hi, counted = _counting.scan(values, self.radius, self.counts, scratch)
            except (BufferError, ValueError):  # numpy refuses the buffer of a strided view: copy it
                values = np.ascontiguousarray(values)
                lo, hi, counted = _counting.scan(values, self.radius, self.counts, scratch)
            if counted:
                return lo, hi
            if math.isfinite(lo) and math.isfinite(hi) and max(-lo, hi) > 0:
                self._grow_to(_pow2_above(max(-lo, hi)))
                lo, hi, counted = _counting.scan(values, self.radius, self.counts, scratch)
                if counted:
                    return lo, hi
        lo, hi = float(np.min(values)), float(np.max(values))
        if math.isfinite(lo) and math.isfinite(hi):
            self.add(values, peak=max(-lo, hi))
        else:
            self.add(np.where(np.isfinite(values), values, 0.0))
        return lo, hi

    def merge(self, other: StreamingHistogram) -> None:
        """Add another histogram's counts (same bins and channels) exactly."""
        if other.bins != self.bins or other.channels != self.channels:
            raise ValueError("histograms with different bins or channels cannot be merged")
        if other.radius == 0.0 and not other.counts.any():
            return
        aligned = StreamingHistogram(other.bins, other.channels)
        aligned.radius, aligned.counts = other.radius, other.counts.copy()
        target = max(self.radius, aligned.radius)
        if target > 0:
            self._grow_to(target)
            aligned._grow_to(target)
        self.counts += aligned.counts

    def edges(self) -> np.ndarray:
        """Bin edges, ``2 * bins + 1`` values from ``-R`` to ``R``."""
        return (np.arange(2 * self.bins + 1, dtype=np.float64) - self.bins) * self.width

    def state(self) -> dict[str, Any]:
        """Sparse JSON state: only non-zero counts are stored."""
        flat = self.counts.reshape(-1)
        nonzero = np.flatnonzero(flat)
        return {
            "bins": self.bins,
            "channels": self.channels,
            "radius": self.radius,
            "index": nonzero.tolist(),
            "count": flat[nonzero].tolist(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamingHistogram:
        channels = state["channels"]
        if channels is not None and not (isinstance(channels, int) and 1 <= channels <= MAX_CHANNELS):
            raise ValueError(f"histogram channels must be null or 1 to {MAX_CHANNELS}, got {channels!r:.40}")
        hist = cls(int(state["bins"]), channels)
        hist.radius = float(state["radius"])
        if not (np.isfinite(hist.radius) and hist.radius >= 0):
            raise ValueError(f"histogram radius must be a finite number >= 0, got {hist.radius}")
        flat = hist.counts.reshape(-1)
        index = np.asarray(state["index"], dtype=np.int64)
        count = np.asarray(state["count"], dtype=np.int64)
        if (
            index.shape != count.shape
            or index.ndim != 1
            or (index.size and (index.min() < 0 or index.max() >= flat.size))
        ):
            raise ValueError("histogram index and count must be equal lists of bins inside the histogram")
        if (count < 0).any():
            raise ValueError("histogram counts must be >= 0")
        flat[index] = count
        return hist
