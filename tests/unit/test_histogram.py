from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.observers.histogram import StreamingHistogram


def direct_counts(values: np.ndarray, radius: float, bins: int) -> np.ndarray:
    width = radius / bins
    index = np.clip(np.floor(values / width).astype(np.int64) + bins, 0, 2 * bins - 1)
    return np.bincount(index, minlength=2 * bins)


def test_growing_range_equals_binning_everything_at_the_final_resolution():
    rng = np.random.default_rng(0)
    batches = [rng.normal(0, s, 1000) for s in (0.01, 0.1, 1.0, 30.0)]  # the range grows 4 times
    hist = StreamingHistogram(64)
    for batch in batches:
        hist.add(batch)
    everything = np.concatenate(batches)
    peak = np.abs(everything).max()
    assert hist.radius >= peak > hist.radius / 2  # the smallest power of two >= max |x|
    np.testing.assert_array_equal(hist.counts, direct_counts(everything, hist.radius, 64))
    assert hist.radius == 2.0 ** np.ceil(np.log2(peak))
    assert hist.counts.sum() == everything.size


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=50), min_size=2, max_size=6),
    split=st.integers(1, 5),
)
def test_merging_shards_is_exact_whatever_the_split(data, split):
    batches = [np.asarray(b, np.float32) for b in data]
    split = min(split, len(batches) - 1)
    whole, left, right = StreamingHistogram(16), StreamingHistogram(16), StreamingHistogram(16)
    for b in batches:
        whole.add(b)
    for b in batches[:split]:
        left.add(b)
    for b in batches[split:]:
        right.add(b)
    left.merge(right)
    assert left.radius == whole.radius
    np.testing.assert_array_equal(left.counts, whole.counts)


def test_per_channel_histograms_and_state_round_trip():
    hist = StreamingHistogram(8, channels=3)
    hist.add(np.array([[0.5, -0.5], [3.0, 2.0], [0.0, 0.0]]))
    assert hist.counts.shape == (3, 16) and hist.counts.sum(axis=1).tolist() == [2, 2, 2]
    again = StreamingHistogram.from_state(hist.state())
    assert again.radius == hist.radius
    np.testing.assert_array_equal(again.counts, hist.counts)


def test_bins_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        StreamingHistogram(1000)


def test_values_equal_to_a_power_of_two_merge_exactly():
    whole, left, right = StreamingHistogram(8), StreamingHistogram(8), StreamingHistogram(8)
    whole.add(np.array([1.0, 3.0]))
    left.add(np.array([1.0]))
    right.add(np.array([3.0]))
    left.merge(right)
    np.testing.assert_array_equal(left.counts, whole.counts)
    assert whole.radius == 4.0  # strictly above the largest magnitude
