"""The entropy observer: the clipping threshold that minimises KL divergence (TensorRT's method)."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtool.observers._histogram_base import HistogramObserver, magnitude_counts
from qtool.observers.base import register_observer
from qtool.observers.histogram import DEFAULT_BINS

_CHUNK = 128  # candidate thresholds evaluated together (bounds the work arrays to a few MB)


ENTROPY_MAX_BINS = 16384  # per side of zero; the default is 2048


def kl_divergences(hist: np.ndarray, candidates: np.ndarray, levels: int) -> np.ndarray:
    """KL(P || Q) for each candidate number of kept bins, vectorised over candidates.

    P is ``hist[:i]`` with everything beyond bin ``i`` added to its last bin; Q
    is ``hist[:i]`` merged into ``levels`` groups of ``i // levels`` bins (the last
    group takes the remainder) and spread back evenly over each group's
    non-empty bins.
    """
    hist = hist.astype(np.float64)
    n = len(hist)
    nonzero = (hist > 0).astype(np.float64)
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # suffix[i] = hist[i:].sum()
    result = np.empty(len(candidates))
    j = np.arange(n)
    for start in range(0, len(candidates), _CHUNK):
        kept = candidates[start : start + _CHUNK]
        rows = np.arange(len(kept))[:, None]
        inside = j[None, :] < kept[:, None]
        p = np.where(inside, hist[None, :], 0.0)
        p[rows[:, 0], kept - 1] += suffix[kept]
        # TensorRT's grouping: i // levels bins per level, the last level takes the remainder.
        per_level = (kept // levels)[:, None]
        group = np.minimum(j[None, :] // per_level, levels - 1) + rows * levels
        flat_group = group[inside]
        size = len(kept) * levels
        sums = np.bincount(flat_group, weights=np.broadcast_to(hist, inside.shape)[inside], minlength=size)
        filled = np.bincount(flat_group, weights=np.broadcast_to(nonzero, inside.shape)[inside], minlength=size)
        per_bin = np.divide(sums, filled, out=np.zeros_like(sums), where=filled > 0)
        q = np.where(inside & (hist[None, :] > 0), per_bin[np.minimum(group, len(per_bin) - 1)], 0.0)
        p /= p.sum(axis=1, keepdims=True)
        q_total = q.sum(axis=1, keepdims=True)
        q = np.divide(q, q_total, out=np.zeros_like(q), where=q_total > 0)
        q = np.where((p > 0) & (q <= 0), 1e-12, q)  # smooth: P mass where Q has none
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, p * np.log(p / q), 0.0)
        result[start : start + len(kept)] = terms.sum(axis=1)
    return result


@register_observer
class EntropyObserver(HistogramObserver):
    """Clipping threshold with the least KL divergence between float and quantized values (TensorRT's method).

    Non-negative tensors (after Relu, Softmax) search ``[0, T]`` with 2**bits
    levels; signed tensors search a symmetric ``[-T, T]`` over |x| with
    2**(bits-1) levels. ``bins`` (default 2048) per side of zero.
    """

    name = "entropy"

    def __init__(self, axis: int | None = None, bins: int = DEFAULT_BINS) -> None:
        if isinstance(bins, int) and bins > ENTROPY_MAX_BINS:
            raise ValueError(f"entropy takes at most {ENTROPY_MAX_BINS} bins (its search grows with the square)")
        super().__init__(axis, bins)

    def options(self) -> dict[str, Any]:
        return super().options()

    def _range_1d(
        self, counts: np.ndarray, width: float, lo: float, hi: float, bits: int, symmetric: bool
    ) -> tuple[float, float]:
        one_sided = lo >= 0.0
        hist = counts[self.bins :] if one_sided else magnitude_counts(counts, self.bins)
        levels = 2**bits if one_sided else 2 ** (bits - 1)
        used = int(np.flatnonzero(hist)[-1]) + 1 if hist.any() else 0
        if used <= levels:
            return lo, hi  # every value already has its own level: clipping cannot help
        hist = hist[:used].copy()
        # Exact zeros (after Relu, padding) pile up in the first bin; zero is exactly
        # representable, and the spike would otherwise steer the search to tiny
        # thresholds. Replace it by its neighbour, as NVIDIA's calibrators do.
        hist[0] = hist[1]
        candidates = np.arange(levels, used + 1)
        best = int(candidates[int(np.argmin(kl_divergences(hist, candidates, levels)))])
        threshold = best * width
        return (max(lo, 0.0 if one_sided else -threshold), min(hi, threshold))
