"""AdaRound on synthetic layers: it lowers the output error that nearest rounding leaves, within its bounds."""

from __future__ import annotations

import numpy as np

from qtool.quantization.algorithms.adaround import adaround, reconstruction_error
from qtool.quantization.algorithms.gptq import gptq_round, round_nearest


def _layer(seed: int = 0, rows: int = 32, k: int = 64, bits: int = 4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2048, k)) @ rng.standard_normal((k, k)) * 0.3  # correlated inputs
    h = x.T @ x / len(x)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    qmax = 2 ** (bits - 1) - 1
    scale = (np.abs(w).max(axis=1) / qmax).astype(np.float32)[:, None]
    return w, h, np.broadcast_to(scale, w.shape), np.zeros(w.shape, np.int64), -qmax, qmax


def _error(w, h, codes, scale, zero):
    return reconstruction_error(
        w[None].astype(np.float64), codes[None], scale[None].astype(np.float64), zero[None], h[None]
    )


def test_adaround_beats_nearest_rounding_on_correlated_inputs():
    w, h, scale, zero, qmin, qmax = _layer()
    nearest = round_nearest(w, scale, zero, qmin, qmax)
    result = adaround(w, h, scale, zero, qmin, qmax, iterations=300, seconds=60)
    assert result.improved and result.codes.min() >= qmin and result.codes.max() <= qmax
    assert _error(w, h, result.codes, scale, zero) < 0.7 * _error(w, h, nearest, scale, zero)
    assert result.loss == _error(w, h, result.codes, scale, zero)


def test_started_from_gptq_it_is_never_worse_than_gptq():
    w, h, scale, zero, qmin, qmax = _layer(seed=1)
    gptq = gptq_round(w, h, scale, zero, qmin, qmax).codes
    result = adaround(w, h, scale, zero, qmin, qmax, start=gptq, iterations=200, seconds=60)
    assert _error(w, h, result.codes, scale, zero) <= _error(w, h, gptq, scale, zero) + 1e-9


def test_a_spent_time_budget_returns_the_starting_codes_at_once():
    w, h, scale, zero, qmin, qmax = _layer(seed=2)
    result = adaround(w, h, scale, zero, qmin, qmax, iterations=10_000, seconds=0.0)
    assert result.stopped == "time" and result.iterations == 0
    assert np.array_equal(result.codes, round_nearest(w, scale, zero, qmin, qmax))


def test_grouped_hessians_and_determinism():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 9)).astype(np.float32)  # depthwise-like: 16 groups of one row
    x = rng.standard_normal((16, 512, 9))
    h = np.einsum("gpk,gpl->gkl", x, x) / 512
    scale = np.broadcast_to((np.abs(w).max(axis=1) / 7)[:, None], w.shape).astype(np.float32)
    zero = np.zeros(w.shape, np.int64)
    first = adaround(w, h, scale, zero, -7, 7, iterations=100, seconds=60)
    second = adaround(w, h, scale, zero, -7, 7, iterations=100, seconds=60)
    assert np.array_equal(first.codes, second.codes) and first.loss <= first.start_loss
