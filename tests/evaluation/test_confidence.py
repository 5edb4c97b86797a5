"""Confidence bounds from the per-sample spread, and the selection/validation split."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qtool.calibration.dataset import Dataset, model_inputs
from qtool.evaluation.confidence import SampleEnergies, mean_bound
from qtool.evaluation.split import split_samples, spread_subset
from tests.conftest import eval_dir, sample


def test_equal_samples_bound_at_the_pooled_figure():
    even = SampleEnergies((4.0,) * 8, (0.004,) * 8)  # every sample at 30 dB
    assert even.pooled_db == pytest.approx(30.0)
    assert even.lower_bound_db(0.9) == pytest.approx(30.0)


def test_one_bad_sample_pulls_the_bound_below_the_pooled_figure():
    noise = (0.001,) * 7 + (0.05,)  # one sample holds most of the noise
    spread = SampleEnergies((1.0,) * 8, noise)
    pooled = 10 * math.log10(8 / sum(noise))
    assert spread.pooled_db == pytest.approx(pooled)
    bound = spread.lower_bound_db(0.9)
    assert bound < pooled - 1.0
    # a stricter confidence gives a lower bound; the bound is a resampled set's figure, so within the extremes
    assert spread.lower_bound_db(0.99) < bound
    assert bound > 10 * math.log10(8 / (8 * 0.05))
    # seeded: the same measurements give the same bound, every time
    assert SampleEnergies((1.0,) * 8, noise).lower_bound_db(0.9) == bound


def test_exact_and_single_samples():
    assert SampleEnergies((1.0, 2.0), (0.0, 0.0)).lower_bound_db() == math.inf
    assert SampleEnergies((1.0,), (0.01,)).lower_bound_db() == pytest.approx(20.0)


def test_mean_bound_takes_the_worse_side():
    values = [1.0] * 9 + [0.0]
    assert mean_bound(values, 0.9) < np.mean(values)
    errors = [0.1] * 9 + [1.0]
    assert mean_bound(errors, 0.9, lower_is_better=True) > np.mean(errors)
    assert mean_bound([0.5] * 4, 0.9) == pytest.approx(0.5)


def test_a_sparse_output_bounds_the_noise_against_the_signal_of_every_sample():
    # a text detector's map: two crops with text carry all the signal, six without carry none
    signal = (100.0, 0.0, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0)
    noise = (0.1, 0.001, 0.001, 0.001, 0.1, 0.001, 0.001, 0.001)
    sparse = SampleEnergies(signal, noise)
    pooled = sparse.pooled_db
    bound = sparse.lower_bound_db(0.98)
    assert pooled - 6.0 < bound < pooled  # noise and signal resampled apart: no set "without text" at -inf
    # the signal may come from more samples (every float output at hand): a richer set raises the bound
    assert sparse.lower_bound_db(0.98, signal_mean=50.0) > bound


def test_a_bound_is_never_above_what_its_own_samples_measured():
    # a quiet sequence validated against the signal of a loud one too (tune split a VAD's data by sequence):
    # 30.6 dB measured here must not be promised as 61 dB
    quiet = SampleEnergies((1e-3,) * 8, (1e-6,) * 8)
    assert quiet.pooled_db == pytest.approx(30.0)
    assert quiet.lower_bound_db(0.98, signal_mean=1.0) == pytest.approx(quiet.pooled_db)


def test_the_split_is_by_file_name_hash_and_never_shares_a_sample(tmp_path):
    dataset = Dataset(eval_dir("mlp"), model_inputs(sample_model("mlp")))
    split = split_samples(dataset)
    selection, validation = split.selection_files, split.validation_files
    assert not set(selection) & set(validation)
    assert sorted(selection + validation) == sorted(p.name for p in dataset.files)
    assert len(selection) == len(validation) == len(dataset) // 2
    assert split_samples(dataset).validation_files == validation  # the same files split the same way
    # two kinds of sample saved alternately (text, photo, text, ...): both halves get both kinds
    for i in range(16):
        np.save(tmp_path / f"{i:04d}.npy", np.zeros((1, 16), np.float32))
    alternating = split_samples(Dataset(tmp_path, model_inputs(sample_model("mlp"))))
    for half in (alternating.selection_files, alternating.validation_files):
        kinds = {int(name[:4]) % 2 for name in half}
        assert kinds == {0, 1}, half
    spread = spread_subset(split.selection, 4)
    assert len(spread) == 4 and {p.name for p in spread.files} <= set(selection)
    # the subsets read their own samples only
    assert [path.name for path, _ in split.validation.samples()] == validation


def sample_model(name):
    import onnx

    return onnx.load(str(sample(name)))


def test_a_split_matched_on_output_energy_puts_each_kind_in_both_halves_equally(tmp_path):
    from qtool.evaluation.split import output_energies

    for i in range(16):
        np.save(tmp_path / f"{i:04d}.npy", np.zeros((1, 16), np.float32))
    dataset = Dataset(tmp_path, model_inputs(sample_model("mlp")))
    # eleven crops without text (little output energy), five with text: both halves get their share
    energies = [100.0 + i if i in (1, 4, 9, 12, 15) else 0.01 * (i + 1) for i in range(16)]
    split = split_samples(dataset, energies)
    assert sorted(split.selection_positions + split.validation_positions) == list(range(16))
    text = {1, 4, 9, 12, 15}
    assert {len(text & set(split.selection_positions)), len(text & set(split.validation_positions))} == {2, 3}
    # consecutive by energy, one of each pair in each half
    ranked = sorted(range(16), key=lambda i: energies[i])
    for a, b in zip(ranked[0::2], ranked[1::2], strict=True):
        assert (a in split.selection_positions) != (b in split.selection_positions)
    assert split_samples(dataset, energies).selection_positions == split.selection_positions
    # each output counts relative to its own scale
    assert output_energies({"a": [1.0, 3.0], "b": [100.0, 100.0]}) == [1.5, 2.5]
