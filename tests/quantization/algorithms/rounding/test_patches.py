from __future__ import annotations

import numpy as np
import pytest

from qtool.errors import QtoolError
from qtool.quantization.algorithms.rounding import patches
from qtool.quantization.algorithms.rounding.patches import (
    ConvGeometry,
    MatMulGeometry,
    input_stats,
    sample_positions,
)
from tests.quantization.algorithms.rounding.brute import im2col

CASES = {
    "plain 3x3 pad 1": (4, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    "stride, dilation, asymmetric pads, groups": (4, (3, 2), (2, 1), (1, 0, 2, 1), (2, 1), 2),
    "depthwise stride 2": (6, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 6),
    "1x1": (3, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    "1-D": (4, (3,), (2,), (2, 1), (1,), 2),
}


def _input(channels: int, rank: int, seed: int = 0, length: int = 9) -> np.ndarray:
    spatial = (7, 6)[:rank] if rank == 2 else (length,)
    return np.random.default_rng(seed).normal(1.0, 1.0, (2, channels, *spatial)).astype(np.float32)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_conv_hessian_and_mean_match_brute_force_im2col(case):
    channels, kernel, strides, pads, dilations, group = case
    x = _input(channels, len(kernel))
    geometry = ConvGeometry(kernel, strides, pads, dilations, group)
    stats = input_stats(x, geometry, max_positions=10**6)
    patches = im2col(x, kernel, strides, pads, dilations, group)
    assert stats.hessian_count == stats.mean_count == len(patches)
    np.testing.assert_allclose(stats.hessian_sum, np.einsum("pgk,pgl->gkl", patches, patches), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(stats.mean(), patches.mean(axis=0), rtol=1e-9, atol=1e-12)
    k = channels // group * int(np.prod(kernel))
    assert stats.hessian().shape == (group, k, k) and stats.mean().shape == (group, k)


LONG_KERNEL = (1, (40,), (16,), (0, 0), (1,), 1)  # an audio front end's: many taps, a stride a fraction of them


@pytest.mark.parametrize("many_taps", [0, 1000], ids=["summed-through-one-view", "summed-tap-by-tap"])
@pytest.mark.parametrize("case", [*CASES.values(), LONG_KERNEL], ids=[*CASES, "long strided kernel"])
def test_the_mean_patch_is_im2col_s_whether_taps_are_summed_one_by_one_or_through_one_view(
    case, many_taps, monkeypatch
):
    # an axis of more than MANY_TAPS taps (a 400-tap STFT at stride 160) is summed through one strided view
    monkeypatch.setattr(patches, "MANY_TAPS", many_taps)
    channels, kernel, strides, pads, dilations, group = case
    x = _input(channels, len(kernel), length=1000 if kernel == (40,) else 9)
    stats = input_stats(x, ConvGeometry(kernel, strides, pads, dilations, group), max_positions=10**6)
    expected = im2col(x, kernel, strides, pads, dilations, group)
    assert stats.mean_count == len(expected)
    np.testing.assert_allclose(stats.mean(), expected.mean(axis=0), rtol=1e-9, atol=1e-12)


def test_without_means_the_hessian_is_the_same_and_the_mean_is_left_empty():
    x = _input(4, 2)
    geometry = ConvGeometry((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    full = input_stats(x, geometry, max_positions=50, seed=3)
    bare = input_stats(x, geometry, max_positions=50, seed=3, means=False)
    np.testing.assert_array_equal(bare.hessian_sum, full.hessian_sum)
    assert bare.hessian_count == full.hessian_count and bare.mean_count == 0 and not bare.mean_sum.any()


def test_subsampled_hessian_uses_exactly_the_drawn_positions_and_the_mean_uses_all():
    channels, kernel, strides, pads, dilations, group = CASES["stride, dilation, asymmetric pads, groups"]
    x = _input(channels, 2)
    stats = input_stats(x, ConvGeometry(kernel, strides, pads, dilations, group), max_positions=7, seed=3)
    patches = im2col(x, kernel, strides, pads, dilations, group)
    chosen = patches[sample_positions(len(patches), 7, 3)]
    assert stats.hessian_count == 7 and stats.mean_count == len(patches)
    np.testing.assert_allclose(stats.hessian_sum, np.einsum("pgk,pgl->gkl", chosen, chosen), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.mean(), patches.mean(axis=0), rtol=1e-9, atol=1e-12)


def test_auto_pad_same_matches_the_explicit_pads():
    x = np.random.default_rng(1).normal(size=(1, 2, 8, 8)).astype(np.float32)
    for auto_pad, pads in (("SAME_UPPER", (0, 0, 1, 1)), ("SAME_LOWER", (1, 1, 0, 0)), ("VALID", (0, 0, 0, 0))):
        auto = input_stats(x, ConvGeometry((3, 3), (2, 2), auto_pad=auto_pad))
        explicit = input_stats(x, ConvGeometry((3, 3), (2, 2), pads))
        np.testing.assert_array_equal(auto.hessian_sum, explicit.hessian_sum)
        np.testing.assert_array_equal(auto.mean_sum, explicit.mean_sum)


def test_geometry_from_onnx_attributes():
    geometry = ConvGeometry.from_attributes({"pads": [1, 1, 1, 1], "group": 4, "auto_pad": b"NOTSET"}, (8, 1, 3, 3))
    assert geometry == ConvGeometry((3, 3), None, (1, 1, 1, 1), None, 4, "NOTSET")


def test_matmul_and_gemm_trans_a_reduce_along_their_axis():
    x = np.random.default_rng(2).normal(size=(2, 3, 5)).astype(np.float32)
    stats = input_stats(x, MatMulGeometry())
    rows = x.reshape(-1, 5).astype(np.float64)
    np.testing.assert_allclose(stats.hessian_sum[0], rows.T @ rows, rtol=1e-5)
    np.testing.assert_allclose(stats.mean()[0], rows.mean(axis=0), rtol=1e-12)
    gemm = input_stats(np.ascontiguousarray(x[0].T), MatMulGeometry(reduction_axis=0))  # Gemm transA: A is [K, M]
    a = x[0].astype(np.float64)
    np.testing.assert_allclose(gemm.hessian_sum[0], a.T @ a, rtol=1e-5)


def test_shards_merge_to_the_whole_and_survive_serialisation():
    channels, kernel, strides, pads, dilations, group = CASES["depthwise stride 2"]
    x = _input(channels, 2)
    geometry = ConvGeometry(kernel, strides, pads, dilations, group)
    whole = input_stats(x, geometry)
    first, second = input_stats(x[:1], geometry), input_stats(x[1:], geometry)
    merged = first.merge(second)
    assert merged.hessian_count == whole.hessian_count and merged.mean_count == whole.mean_count
    np.testing.assert_allclose(merged.hessian_sum, whole.hessian_sum, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(merged.mean_sum, whole.mean_sum, rtol=1e-12)


def test_mismatched_shards_and_damaged_arrays_are_refused():
    a = input_stats(np.ones((1, 4), np.float32), MatMulGeometry())
    b = input_stats(np.ones((1, 5), np.float32), MatMulGeometry())
    with pytest.raises(QtoolError, match="different models"):
        a.merge(b)


def test_a_collectors_running_sums_accumulate_in_place_to_what_merging_gives():
    rng = np.random.default_rng(5)
    geometry = ConvGeometry((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    first, second = (input_stats(rng.standard_normal((1, 4, 6, 6)), geometry, max_positions=20) for _ in range(2))
    merged = first.merge(second)
    hessian = first.hessian_sum
    rng = np.random.default_rng(5)  # the second batch again, its Hessian sum left float32 as the product gave it
    input_stats(rng.standard_normal((1, 4, 6, 6)), geometry, max_positions=20)
    batch = input_stats(rng.standard_normal((1, 4, 6, 6)), geometry, max_positions=20, batch_sums=True)
    assert batch.hessian_sum.dtype == np.float32 and first.hessian_sum.dtype == np.float64
    running = first.accumulated(batch)
    assert running.hessian_sum is hessian  # no new [K, K] array
    assert np.array_equal(running.hessian_sum, merged.hessian_sum) and np.array_equal(running.mean_sum, merged.mean_sum)
    assert (running.hessian_count, running.mean_count) == (merged.hessian_count, merged.mean_count)
    other = input_stats(rng.standard_normal((1, 3, 6, 6)), geometry)
    with pytest.raises(QtoolError, match="cannot merge"):
        running.accumulated(other)
