from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.observers import histogram
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


# The compiled kernel (_counting.c) and numpy must count alike, value for value.
KERNEL = pytest.mark.skipif(histogram._counting is None, reason="the compiled counting kernel is not built")


def test_the_kernel_is_built_in_ci():
    if histogram._counting is None and os.environ.get("CI"):
        pytest.fail("qtool.observers._counting is not built: `make dev` compiles it (it needs a C compiler)")


def _both_paths(monkeypatch, batches, bins):
    """(radius, counts, extremes) from the kernel and from numpy, over the same batches."""
    found = []
    for kernel in (histogram._counting, None):
        with monkeypatch.context() as patch:
            patch.setattr(histogram, "_counting", kernel)
            hist = StreamingHistogram(bins)
            extremes = [hist.add_with_extremes(b) for b in batches]
        found.append((hist.radius, hist.counts, extremes))
    return found


def _assert_same(kernel, numpy_path):
    assert kernel[0] == numpy_path[0]
    np.testing.assert_array_equal(kernel[1], numpy_path[1])
    np.testing.assert_array_equal(np.asarray(kernel[2]), np.asarray(numpy_path[2]))  # NaN equals NaN here


def _edges(radius: float, bins: int) -> np.ndarray:
    """Every bin edge and the float32 values either side of it."""
    edges = ((np.arange(2 * bins) - bins) * (radius / bins)).astype(np.float32)
    return np.concatenate([edges, np.nextafter(edges, np.float32(-np.inf)), np.nextafter(edges, np.float32(np.inf))])


TINY = np.array([-1e-45, -1e-40, -3e-39, 1e-45, 1e-40, -0.0, 0.0], np.float32)  # subnormals and zeros


@KERNEL
@pytest.mark.parametrize("bins", [8, 2048, 1 << 16])
@pytest.mark.parametrize(
    "batches",
    [
        [_edges(8.0, 2048)],  # values on and either side of every bin edge (a large batch)
        [_edges(8.0, 2048)[:999]],  # the same, small enough for the kernel's two-pass route
        [np.concatenate([TINY, np.float32([5e4])])],  # bins wider than 1: tiny negatives underflow to -0.0
        [np.concatenate([np.tile(TINY, 3000), np.float32([3e7])])],
        [np.float32([1e-38, -1e-38]), np.float32([3e38, -3e38])],  # tiny and huge radii (float64 arithmetic)
        [np.zeros(10, np.float32), np.zeros(20_000, np.float32), np.float32([0.5, -0.25])],  # radius 0 first
        [np.float32([1.0, 2.0, 4.0]), np.float32([-4.0]), np.float32([-4.0] * 5000)],  # powers of two grow it
        [np.float32([np.nan, 1.0]), np.float32([np.inf, 2.0] * 5000), np.float32([1.0, -np.inf])],  # non-finite
        [np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * s for s in (1e-3, 1.0, 1e3)],
    ],
    ids=["edges", "edges-small", "underflow", "underflow-large", "extreme-radii", "zeros", "pow2", "nonfinite", "grow"],
)
def test_the_kernel_counts_exactly_as_numpy(monkeypatch, batches, bins):
    _assert_same(*_both_paths(monkeypatch, batches, bins))


@KERNEL
@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=300),
        min_size=1,
        max_size=4,
    ),
    repeat=st.sampled_from([1, 20]),  # 20: batches of up to 6000 values take the kernel's one-pass route
)
def test_the_kernel_counts_any_float32_as_numpy(data, repeat):
    batches = [np.tile(np.asarray(b, np.float32), repeat) for b in data]
    with pytest.MonkeyPatch.context() as patch:
        _assert_same(*_both_paths(patch, batches, 64))


@KERNEL
def test_the_kernel_refuses_what_it_cannot_count():
    counts, scratch = np.zeros(16, np.int64), np.zeros(4 * (16 + 16), np.uint32)
    scan = histogram._counting.scan
    with pytest.raises(TypeError, match="float32"):
        scan(np.zeros(4, np.float64), 1.0, counts, scratch)
    with pytest.raises(TypeError, match="int64"):
        scan(np.zeros(4, np.float32), 1.0, np.zeros(16, np.int32), scratch)
    with pytest.raises(TypeError, match="scratch"):
        scan(np.zeros(4, np.float32), 1.0, counts, scratch[:-1])
    with pytest.raises(ValueError, match="radius"):
        scan(np.zeros(4, np.float32), -1.0, counts, scratch)
    assert scan(np.float32([3.0]), 2.0, counts, scratch) == (3.0, 3.0, False)  # out of range: nothing counted
    assert scan(np.full(10_000, 3.0, np.float32), 2.0, counts, scratch) == (3.0, 3.0, False)
    assert not counts.any() and not scratch.any()  # the scratch comes back zeroed
    assert scan(np.full(10_000, 1.5, np.float32), 2.0, counts, scratch) == (1.5, 1.5, True)
    assert counts[8 + 6] == 10_000 and not scratch.any()
