"""Distribution-free confidence intervals of a median, from order statistics.

For n independent draws, the k-th smallest and the k-th largest bracket the population median with
probability 1 - 2 P(Binomial(n, 1/2) < k), whatever the distribution: no bootstrap, so the same
timings always give the same interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

CONFIDENCE = 0.99  # latency gates fail only when a 99 % interval says so


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The narrowest order-statistic interval holding the median with at least ``confidence``.

    None when there are too few values for that confidence (6 for 95 %, 8 for 99 %).
    """
    n = len(values)
    if not 0 < confidence < 1 or n == 0:
        return None
    ordered = sorted(values)
    tail = (1 - confidence) / 2
    total = 2**n
    below = 0  # count of outcomes with fewer than k successes, for k = 1, 2, ...
    best = None
    for k in range(1, n // 2 + 1):
        below += comb(n, k - 1)
        if below / total > tail:
            break
        best = k
    if best is None:
        return None
    return ordered[best - 1], ordered[n - best]
