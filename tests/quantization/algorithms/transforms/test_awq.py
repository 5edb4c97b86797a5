from __future__ import annotations

import numpy as np
import pytest

from qtool.quantization.algorithms.transforms.awq import (
    MEAN_FLOOR,
    AwqReader,
    InputMoments,
    channel_scales,
    choose_awq_scales,
)
from qtool.schemes import TensorScheme


def _layer(seed: int, outliers: int, k: int = 256, n: int = 64, tokens: int = 256):
    """A weight [K, N] and calibration inputs [T, K]; ``outliers`` channels are 20x larger."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.05, size=(k, n)).astype(np.float32)
    gain = np.ones(k, np.float32)
    gain[rng.choice(k, outliers, replace=False)] = 20.0
    return weight, (rng.normal(size=(tokens, k)) * gain).astype(np.float32)


def test_quiet_channels_keep_finite_bounded_scales():
    _, sample = _layer(10, outliers=0)
    mean = np.abs(sample).mean(axis=0)
    mean[:3] = 0.0  # inputs that were always zero
    for alpha in (0.0, 0.5, 0.95):
        s = channel_scales(mean, alpha)
        assert np.all(np.isfinite(s)) and np.all(s > 0)
        assert s.max() / s.min() <= (1 / MEAN_FLOOR) ** alpha * (1 + 1e-5)
        assert s.max() * s.min() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_array_equal(channel_scales(np.zeros(8), 0.5), 1.0)


INT4 = TensorScheme("int4", "per_block", True, 32)


def _search(weight: np.ndarray, sample: np.ndarray, mean_abs: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """What the AWQ pass chooses for one MatMul reading ``x`` (int4, blocks of 32 along K)."""
    moments = InputMoments(["x"])
    moments.observe({"x": sample}, len(sample), {})
    if mean_abs is not None:
        moments.mean_abs["x"] = mean_abs * len(sample)
    chosen, skipped = choose_awq_scales([AwqReader("mm", "x", weight, INT4, 32)], moments)
    assert not skipped
    return chosen["x"]


def test_search_gives_outlier_channels_the_largest_scales():
    weight, sample = _layer(0, outliers=4)
    s, alpha = _search(weight, sample)
    assert alpha > 0
    assert set(np.argsort(s)[-4:]) == set(np.argsort(np.abs(sample).mean(axis=0))[-4:])


def test_uniform_channels_choose_alpha_zero():
    weight, sample = _layer(4, outliers=0)
    s, alpha = _search(weight, sample, mean_abs=np.full(weight.shape[0], 0.8))
    assert alpha == 0.0
    np.testing.assert_array_equal(s, 1.0)
