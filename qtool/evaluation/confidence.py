"""How far a figure measured on a few samples carries to new ones: lower confidence bounds from the per-sample spread.

An SQNR over a set of samples is a ratio of sums (signal energy over noise energy), so one sample
whose output the quantized model gets wrong can hold most of the noise. Resampling the samples
with replacement (a bootstrap) shows how the mean noise energy moves when another set of the same
size is drawn: its upper quantile, against the mean signal energy, is the bound a promise can rest
on. The signal is the float model's alone, so it may come from more samples than the noise (every
sample at hand): with sparse outputs (a text detector's map is empty on a crop without text) a
resampled set without a single text crop would otherwise make the signal vanish and the bound
with it. The resampling uses a fixed seed, so the same measurements always give the same bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.9  # one-sided: the figure on a new set of as many samples is at least the bound 9 times in 10
RESAMPLES = 4000
SEED = 20261127


@dataclass(frozen=True)
class SampleEnergies:
    """One output's float signal energy and quantization-noise energy, per sample."""

    signal: tuple[float, ...]
    noise: tuple[float, ...]

    @property
    def pooled_db(self) -> float:
        """The SQNR over all the samples together (``+inf``: exact)."""
        return ratio_db(sum(self.signal), sum(self.noise))

    def lower_bound_db(self, confidence: float = CONFIDENCE, signal_mean: float | None = None) -> float:
        """The SQNR reached with ``confidence``: mean signal over the bootstrap's upper bound of the mean noise.

        ``signal_mean``: the float outputs' mean energy per sample over a larger set (default: these samples').
        A bound is never above what these samples measured: a larger set's signal (loud samples elsewhere)
        must not lift the bound of quiet ones past their own SQNR.
        """
        signal = float(np.mean(self.signal)) if signal_mean is None else signal_mean
        noise = np.asarray(self.noise, np.float64)
        if noise.size < 2 or not noise.any():
            bound = ratio_db(signal, float(noise.mean()) if noise.size else 0.0)
        else:
            means = noise[_draws(noise.size)].mean(axis=1)
            bound = ratio_db(signal, -_quantile(-means, 1.0 - confidence))
        return min(bound, self.pooled_db)


def ratio_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), with an exact match +inf and a silent reference -inf.

    Energies that are not finite (outputs past float range, or NaN) give no figure to vouch for:
    -inf, unless the signal alone is infinite over a finite noise (+inf).
    """
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    ratio = signal / noise
    if not 0.0 < ratio < math.inf:
        return math.inf if ratio == math.inf and math.isfinite(noise) else -math.inf
    return 10.0 * math.log10(ratio)


def mean_bound(values: Sequence[float], confidence: float = CONFIDENCE, *, lower_is_better: bool = False) -> float:
    """The mean of ``values`` a new set of as many samples reaches with ``confidence`` (its worse side)."""
    array = np.asarray(values, np.float64)
    if array.size < 2:
        return float(array.mean()) if array.size else math.nan
    means = array[_draws(array.size)].mean(axis=1)
    if lower_is_better:
        return -_quantile(-means, 1.0 - confidence)
    return _quantile(means, 1.0 - confidence)


def _draws(n: int) -> np.ndarray:
    """RESAMPLES rows of n sample positions drawn with replacement (the same rows for the same n)."""
    return np.random.default_rng(SEED + n).integers(0, n, size=(RESAMPLES, n))


def _quantile(values: np.ndarray, share: float) -> float:
    """The value below which ``share`` of ``values`` lie (an order statistic: no interpolation across inf)."""
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.floor(share * len(ordered))))])
