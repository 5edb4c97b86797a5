"""Selection and validation apart: the samples that choose a model never judge the promise made for it.

A figure measured on the samples that chose among many candidates is optimistic: the choice keeps
whatever happened to score well there. The samples are split in two halves by a hash of their file
names: the same files always split the same way, and no order they were saved in (one class after
another, or two kinds alternating) can put one kind of sample in one half only.

When the float model's outputs are known, the halves are matched on them: the samples are ranked
by their output energy and each consecutive pair is split between the halves (the hash decides
which goes where). A text detector's crops with text and without, a classifier's confident and
uncertain inputs, end up in both halves in equal numbers, so the validation half is a fair sample
of the set rather than, by chance, its hardest or easiest part.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qtool.calibration.dataset import Dataset, sequences, spread_positions


@dataclass(frozen=True)
class SampleSplit:
    """Which samples choose and which judge: no file is in both."""

    selection: Dataset
    validation: Dataset
    selection_positions: list[int]  # of each selection sample in the whole set's sorted files
    validation_positions: list[int]

    @property
    def selection_files(self) -> list[str]:
        return [path.name for path in self.selection.files]

    @property
    def validation_files(self) -> list[str]:
        return [path.name for path in self.validation.files]


def split_samples(dataset: Dataset, energies: Sequence[float] | None = None) -> SampleSplit:
    """Half of ``dataset`` selects, the other half validates (a single sample only selects).

    ``energies``: one figure per sample of the float model's outputs (see :func:`output_energies`):
    the halves are matched on it. Without it, they are drawn by a hash of the file names.
    """
    if any(path.parent != dataset.directory for path in dataset.files):
        return _split_sequences(dataset)
    digests = [_digest(path.name) for path in dataset.files]
    if energies is None:
        shuffled = sorted(range(len(dataset)), key=lambda i: (digests[i], i))
        selection, validation = shuffled[0::2], shuffled[1::2]
    else:
        ranked = sorted(range(len(dataset)), key=lambda i: (energies[i], digests[i], i))
        pairs = [sorted(ranked[k : k + 2], key=lambda i: (digests[i], i)) for k in range(0, len(ranked), 2)]
        selection, validation = [pair[0] for pair in pairs], [pair[1] for pair in pairs if len(pair) == 2]
    selection, validation = sorted(selection), sorted(validation)
    return SampleSplit(dataset.subset(selection), dataset.subset(validation), selection, validation)


def _split_sequences(dataset: Dataset) -> SampleSplit:
    """Data laid out as sequences is split by sequence (a hash of the folder names): each half holds whole ones."""
    groups = sequences(dataset.files)
    if len(groups) < 2:  # one sequence: its first half selects, its second validates (from its file's state)
        order, half = list(range(len(dataset))), (len(dataset) + 1) // 2
        return SampleSplit(dataset.subset(order[:half]), dataset.subset(order[half:]), order[:half], order[half:])
    ranked = sorted(range(len(groups)), key=lambda g: (_digest(dataset.files[groups[g][0]].parent.name), g))
    selection = sorted(i for g in ranked[0::2] for i in groups[g])
    validation = sorted(i for g in ranked[1::2] for i in groups[g])
    return SampleSplit(dataset.subset(selection), dataset.subset(validation), selection, validation)


def output_energies(signal: Mapping[str, Sequence[float]]) -> list[float]:
    """One figure per sample from each float output's energy per sample: each output relative to its mean."""
    count = len(next(iter(signal.values()), []))
    totals = [0.0] * count
    for energies in signal.values():
        mean = sum(energies) / len(energies) if energies else 0.0
        for i, energy in enumerate(energies):
            totals[i] += energy / mean if mean > 0 else 0.0
    return totals


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()


def spread_subset(dataset: Dataset, count: int) -> Dataset:
    """``count`` samples of ``dataset`` spread evenly over it."""
    return dataset.subset(spread_positions(len(dataset), count))
