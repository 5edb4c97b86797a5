from __future__ import annotations

import json

import numpy as np
import pytest

from qtool.errors import QtoolError
from qtool.numerics.qparams import QUANT_TYPES, compute_qparams, dequantize, quantize
from qtool.observers import (
    EntropyObserver,
    MeanStdObserver,
    MinMaxObserver,
    MovingAverageObserver,
    MseObserver,
    PercentileObserver,
    builtin_observers,
    create_observer,
    histogram,
    observer_class,
)
from qtool.observers._reduce import reduce_min_max

ALL = ["entropy", "mean_std", "minmax", "moving_average", "mse", "percentile"]
EXACT_MERGE = ["entropy", "mean_std", "minmax", "mse", "percentile"]


def quantization_mse(x: np.ndarray, lo, hi, symmetric: bool) -> float:
    qtype = QUANT_TYPES["int8" if symmetric else "uint8"]
    qp = compute_qparams(lo, hi, qtype, symmetric=symmetric)
    return float(np.mean((dequantize(quantize(x, qp), qp) - x) ** 2))


def test_every_builtin_is_registered():
    assert sorted(builtin_observers()) == ALL


def test_minmax_tracks_extremes_across_batches():
    obs = MinMaxObserver()
    obs.observe(np.array([1.0, 2.0]))
    obs.observe(np.array([-3.0, 0.5]))
    lo, hi = obs.range(8, False)
    assert float(lo) == -3.0 and float(hi) == 2.0


def test_minmax_fast_path_keeps_numpys_semantics_for_zeros_and_nan():
    batches = [np.float32([0.0, 1.0]), np.float32([-0.0, 2.0]), np.float32([-0.0, -0.0]), np.float32([0.0, 0.5])]
    batches += [np.float32([np.nan, 3.0]), np.float32([-5.0, 9.0])]
    fast, reference = MinMaxObserver(), MinMaxObserver()
    for batch in batches:
        fast.observe(batch)
        reference.update(*reduce_min_max(batch, None))  # np.minimum / np.maximum, as before the fast path
        assert json.dumps(fast.state()) == json.dumps(reference.state())


def test_moving_average_follows_the_ema_formula():
    obs = MovingAverageObserver(averaging_constant=0.5)
    obs.observe(np.array([0.0, 4.0]))
    obs.observe(np.array([-2.0, 2.0]))
    lo, hi = obs.range(8, False)
    assert float(lo) == -1.0 and float(hi) == 3.0


def test_mean_std_is_mean_plus_minus_k_sigma_clipped_to_the_extremes():
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 0.5, 100_000)
    obs = MeanStdObserver(k=2.0)
    for chunk in np.split(x, 10):
        obs.observe(chunk)
    lo, hi = obs.range(8, False)
    assert float(lo) == pytest.approx(x.mean() - 2 * x.std(), rel=1e-9)
    assert float(hi) == pytest.approx(x.mean() + 2 * x.std(), rel=1e-9)
    tiny = MeanStdObserver(k=100.0)
    tiny.observe(np.array([1.0, 2.0]))
    assert [float(v) for v in tiny.range(8, False)] == [1.0, 2.0]


def test_percentile_matches_numpy_within_a_bin():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(200_000)
    obs = PercentileObserver(percentile=99.0)
    obs.observe(x)
    lo, hi = obs.range(8, False)
    width = obs.histogram.width
    assert abs(float(hi) - np.percentile(x, 99.0)) <= width
    assert abs(float(lo) - np.percentile(x, 1.0)) <= width
    _, sym = obs.range(8, True)
    assert abs(float(sym) - np.percentile(np.abs(x), 99.0)) <= width


@pytest.mark.parametrize("name", ["entropy", "mse", "percentile"])
def test_clipping_observers_beat_minmax_on_heavy_tailed_data(name):
    rng = np.random.default_rng(2)
    x = rng.laplace(0, 1, 200_000).astype(np.float32)
    x[:5] = [60.0, -55.0, 48.0, -70.0, 65.0]  # a few outliers stretch min/max
    obs = create_observer(name)
    obs.observe(x)
    lo, hi = obs.range(8, True)
    assert float(hi) < 65.0
    bulk = x[np.abs(x) < 8]  # the values that matter: all but a handful
    assert quantization_mse(bulk, lo, hi, True) < 0.5 * quantization_mse(bulk, x.min(), x.max(), True)
    if name == "mse":  # it optimises the error over everything, outliers included
        assert quantization_mse(x, lo, hi, True) < quantization_mse(x, x.min(), x.max(), True)


def test_entropy_searches_one_sided_for_non_negative_tensors():
    rng = np.random.default_rng(3)
    x = np.maximum(rng.normal(0, 1, 100_000), 0).astype(np.float32)
    x[0] = 40.0
    obs = EntropyObserver()
    obs.observe(x)
    lo, hi = obs.range(8, False)
    assert float(lo) == 0.0 and 2.0 < float(hi) < 40.0


def test_mse_observer_picks_the_lowest_error_range_it_tried():
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, 50_000).astype(np.float32)
    obs = MseObserver(candidates=50)
    obs.observe(x)
    lo, hi = obs.range(8, False)
    chosen = quantization_mse(x, lo, hi, False)
    for fraction in (0.5, 0.8, 1.0):
        assert chosen <= quantization_mse(x, fraction * x.min(), fraction * x.max(), False) * 1.05


@pytest.mark.parametrize("name", ["entropy", "mse", "percentile"])
def test_histogram_observers_write_the_same_statistics_with_or_without_the_kernel(monkeypatch, name):
    rng = np.random.default_rng(7)
    batches = [rng.normal(0, s, (2, 3000)).astype(np.float32) for s in (0.1, 10.0, 1.0)]
    batches += [np.float32([-0.0, 0.0]), np.float32([0.0, -0.0]), np.float32([np.nan, 1.0])]
    states = []
    for kernel in (histogram._counting, None):
        monkeypatch.setattr(histogram, "_counting", kernel)
        obs = create_observer(name)
        for batch in batches[:-1]:
            obs.observe(batch)
        states.append(json.dumps(obs.state()))
        obs.observe(batches[-1])
        states.append(json.dumps(obs.state()))  # NaN extremes: compared as text
    assert states[0] == states[2] and states[1] == states[3]
    assert "-0.0" not in states[0]  # which zero a batch holds first leaves no trace


@pytest.mark.parametrize("name", ALL)
def test_per_channel_ranges_have_one_value_per_channel(name):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 3, 10)) * np.array([1.0, 10.0, 100.0])[None, :, None]
    obs = create_observer(name, axis=1)
    obs.observe(x)
    lo, hi = obs.range(8, False)
    assert lo.shape == (3,) and hi.shape == (3,)
    assert hi[0] < hi[1] < hi[2]


@pytest.mark.parametrize("name", EXACT_MERGE)
def test_merged_shards_give_exactly_the_single_run_range(name):
    rng = np.random.default_rng(6)
    batches = [rng.normal(0, scale, 5000) for scale in (0.1, 5.0, 1.0, 20.0, 0.5, 2.0)]
    whole, left, right = create_observer(name), create_observer(name), create_observer(name)
    for i, b in enumerate(batches):
        whole.observe(b)
        (left if i % 2 else right).observe(b)
    left.merge(right)
    for symmetric in (True, False):
        np.testing.assert_allclose(left.range(8, symmetric), whole.range(8, symmetric), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ALL)
def test_state_round_trips_through_json(name):
    import json

    obs = create_observer(name)
    obs.observe(np.linspace(-2, 3, 1000))
    restored = observer_class(name).from_state(json.loads(json.dumps(obs.state())), None, obs.options())
    np.testing.assert_array_equal(restored.range(8, False), obs.range(8, False))
    assert restored.state() == obs.state()


def test_merge_refuses_other_settings():
    with pytest.raises(QtoolError, match="cannot merge"):
        MinMaxObserver(axis=0).merge(MinMaxObserver(axis=None))
    with pytest.raises(QtoolError, match="cannot merge"):
        PercentileObserver(percentile=99.0).merge(PercentileObserver(percentile=99.9))


def test_unknown_names_and_options_are_clear_errors():
    with pytest.raises(QtoolError, match=r"available observers: .*minmax"):
        observer_class("nope")
    with pytest.raises(QtoolError, match=r"has no option 'percentil'.*percentile"):
        create_observer("percentile", options={"percentil": 99})
    with pytest.raises(QtoolError, match="percentile must be in"):
        create_observer("percentile", options={"percentile": 20})


def test_package_module_class_reference_loads_the_class():
    obs = create_observer("qtool.observers.minmax:MinMaxObserver")
    assert isinstance(obs, MinMaxObserver) and obs.reference == "qtool.observers.minmax:MinMaxObserver"
    with pytest.raises(QtoolError, match="cannot import observer module"):
        create_observer("no_such_module_xyz:Thing")
    with pytest.raises(QtoolError, match="not a subclass"):
        create_observer("numpy:ndarray")


def test_non_finite_values_make_the_range_non_finite():
    obs = PercentileObserver()
    obs.observe(np.array([1.0, np.inf, -2.0]))
    _, hi = obs.range(8, False)
    assert not np.isfinite(hi)
