"""Iterate a dataset directory lazily into onnxruntime input feeds.

Supported layouts (auto-detected): ``*.npy`` files, one sample each, for
single-input models; ``*.npz`` files whose keys are the model's input names.
A decoder's token files need only ``input_ids`` (``.npz`` or ``.npy``): the empty key/value cache,
the attention mask and the positions of a prefill are filled in (see :mod:`qtool.calibration.decoder`).
Samples may include the batch dimension or leave it out. Files are read one at
a time, in sorted order, so memory never holds the whole dataset.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qtool.calibration.dataset_types import Feed, InputSpec, model_inputs
from qtool.calibration.decoder import complete_feed, find_decoder
from qtool.calibration.samples import read_npy, read_npz, read_tensor_proto, tensor_values
from qtool.errors import QtoolError

log = logging.getLogger(__name__)

__all__ = ["IMAGE_SUFFIXES", "Dataset", "Feed", "InputSpec", "model_inputs", "spread_positions"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
FORMATS = ("npy", "npz", "onnx-test-data", "images")


def _detect(directory: Path) -> tuple[str, list[Path]]:
    """Find the one sample format a directory holds, and its samples in sorted order."""
    found = {
        "npy": sorted(directory.glob("*.npy")),
        "npz": sorted(directory.glob("*.npz")),
        "onnx-test-data": sorted(p for p in directory.glob("test_data_set_*") if p.is_dir()),
        "images": sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES),
    }
    present = [name for name, items in found.items() if items]
    if not present:  # a folder per sequence, its chunks in order (a streaming model's data)
        found = {kind: _sequence_files(directory, kind) for kind in ("npy", "npz")}
        present = [name for name, items in found.items() if items]
    if len(present) > 1:
        raise QtoolError(
            f"{directory} mixes sample formats ({', '.join(present)})", hint="keep one format per directory"
        )
    if not present:
        raise QtoolError(
            f"data directory {directory} holds no samples",
            hint="expected *.npy, *.npz, test_data_set_*/input_*.pb, *.png/*.jpg images, or a folder of "
            ".npz/.npy chunks per sequence",
        )
    return present[0], found[present[0]]


def _sequence_files(directory: Path, kind: str) -> list[Path]:
    """The ``*.{kind}`` files of ``directory``'s sub-folders, folder by folder in sorted order (sequences)."""
    folders = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [path for folder in folders for path in sorted(folder.glob(f"*.{kind}"))]


def in_sequences(directory: Path, items: Sequence[Path]) -> bool:
    """Whether ``items`` are laid out as sequences: chunks in sub-folders of ``directory``, not files of it."""
    return any(path.parent != directory for path in items)


def _spread(directory: Path, items: list[Path], count: int) -> list[Path]:
    """``count`` samples spread evenly over ``items``; over sequences, whole sequences (as many as that takes)."""
    if not in_sequences(directory, items):
        return [items[i] for i in spread_positions(len(items), count)]
    groups = sequences(items)
    wanted = min(len(groups), max(1, -(-count * len(groups) // len(items))))  # sequences of the mean length
    return [items[i] for g in spread_positions(len(groups), wanted) for i in groups[g]]


class SequenceOrder:
    """Tells, chunk by chunk, whether a sample continues the one before it: the next chunk of its sequence folder.

    Only data laid out as sequences (sub-folders of the data directory) has any: a flat folder's samples are
    independent of each other, and a chunk whose predecessor in its folder is not the sample before it (a
    subset that skips chunks, a skipped non-finite sample) starts again from the state its file holds.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._positions: dict[Path, dict[Path, int]] = {}  # each sequence folder's chunks: position in order

    def follows(self, path: Path, before: Path | None) -> bool:
        folder = path.parent
        if before is None or folder == self.directory or folder != before.parent:
            return False
        if folder not in self._positions:
            chunks = sorted(p for p in folder.iterdir() if p.suffix == path.suffix)
            self._positions[folder] = {chunk: i for i, chunk in enumerate(chunks)}
        position = self._positions[folder]
        return path in position and before in position and position[path] == position[before] + 1


def continuations(directory: Path, paths: Sequence[Path]) -> list[bool]:
    """Whether each of ``paths`` continues the one before it (see :class:`SequenceOrder`)."""
    order = SequenceOrder(directory)
    return [order.follows(path, paths[i - 1] if i else None) for i, path in enumerate(paths)]


def _shard(directory: Path, items: list[Path], k: int, n: int) -> list[Path]:
    """Every n-th sample from the k-th; over sequences, every n-th whole sequence (a state runs through it)."""
    if not in_sequences(directory, items):
        return items[k - 1 :: n]
    return [items[i] for group in sequences(items)[k - 1 :: n] for i in group]


def sequences(files: Sequence[Path]) -> list[list[int]]:
    """The positions of ``files`` grouped by folder, in order: one sequence of chunks per folder."""
    grouped: dict[Path, list[int]] = {}
    for index, path in enumerate(files):
        grouped.setdefault(path.parent, []).append(index)
    return list(grouped.values())


# A sample holds one batch row (or a few, with a dynamic batch dimension): more than this many times
# what the model's inputs take is not a sample of this model, and is refused before it is read.
_BATCH_ROWS_WITH_DYNAMIC_BATCH = 1024


def _sample_bytes(inputs: list[InputSpec]) -> int | None:
    """The most array bytes one sample can sensibly hold, when the inputs' shapes say (None: unknown)."""
    total = 0
    for spec in inputs:
        if spec.shape is None or not spec.shape:
            return None
        rest = [d for d in spec.shape[1:] if isinstance(d, int)]
        if len(rest) != len(spec.shape) - 1:
            return None
        first = spec.shape[0]
        rows = max(first, 1) if isinstance(first, int) else _BATCH_ROWS_WITH_DYNAMIC_BATCH
        total += rows * int(np.prod(rest, dtype=np.int64)) * spec.dtype.itemsize
    return total + (64 << 10)


_NOTICED: set[str] = set()


def _notice_guessed_preprocess(directory: Path, how: str) -> None:
    """Say once per process what is done to images no ``preprocess:`` block describes (a guess from the model)."""
    if how in _NOTICED:
        return
    _NOTICED.add(how)
    log.warning(
        "images in %s: no preprocess: block in the config, so each is %s (from the model's input); "
        "if the model was trained on normalized inputs, set preprocess: {mean: [...], std: [...]}",
        directory,
        how,
    )


def spread_positions(total: int, count: int) -> list[int]:
    """``count`` positions spread evenly over ``total`` items (all of them when there are no more)."""
    if count >= total:
        return list(range(total))
    return [(2 * i + 1) * total // (2 * count) for i in range(count)]


class Dataset:
    """A directory of samples, validated against a model's inputs and read lazily.

    Formats (auto-detected): ``*.npy`` (single-input models), ``*.npz`` (keys are
    input names), ONNX test-data sets ``test_data_set_*/input_*.pb``, and images
    (``*.png``, ``*.jpg``, ``*.jpeg``) turned into the model's single input by
    :mod:`qtool.calibration.preprocess`.

    Args:
        directory: the dataset directory.
        inputs: the model's inputs (see :func:`model_inputs`).
        limit: use only the first ``limit`` samples (sorted by name).
        spread: use only this many samples, spread evenly over the whole (sorted) set: the
            middle one of each of ``spread`` equal stretches.
        shard: ``(k, n)`` keeps every n-th of those samples starting with the k-th
            (1-based), so ``n`` shards together cover each sample exactly once; data laid out as
            sequences is sharded by whole sequences.
        preprocess: the config's ``preprocess:`` block, for images.
        skip_nonfinite: skip samples holding NaN or Inf (counted in
            ``skipped``) instead of failing.
    """

    def __init__(
        self,
        directory: Path | str,
        inputs: list[InputSpec],
        limit: int | None = None,
        shard: tuple[int, int] | None = None,
        preprocess: dict[str, Any] | None = None,
        skip_nonfinite: bool = False,
        spread: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.inputs = inputs
        self.skip_nonfinite = skip_nonfinite
        self.skipped: list[Path] = []
        self._ignored_noted = False
        if not self.directory.exists():
            raise QtoolError(f"data directory not found: {self.directory}")
        if not self.directory.is_dir():
            raise QtoolError(f"{self.directory} is not a directory")
        self.format, items = _detect(self.directory)
        self.decoder = find_decoder(inputs)  # token files may leave out its cache, mask and positions
        fed = len(inputs) - len(self.decoder.filled) if self.decoder else len(inputs)
        if self.format in ("npy", "images") and fed != 1:
            names = ", ".join(i.name for i in inputs)
            raise QtoolError(
                f"{self.directory}: {self.format} samples only fit single-input models, this model has inputs {names}",
                hint="store each sample as an .npz file whose keys are the input names",
            )
        self.preprocess = None
        if self.format == "images":
            from qtool.calibration.preprocess import build_preprocess

            self.preprocess = build_preprocess(preprocess, inputs[0].shape or (), inputs[0].dtype.name)
            if not preprocess:
                _notice_guessed_preprocess(self.directory, self.preprocess.describe())
        total = len(items)
        items = items[:limit] if limit else items
        if spread is not None:
            items = _spread(self.directory, items, spread)
        if shard is not None:
            k, n = shard
            if not 1 <= k <= n:
                raise QtoolError(f"shard {k}/{n} does not exist", hint="use K/N with 1 <= K <= N")
            items = _shard(self.directory, items, k, n)
            if not items:
                raise QtoolError(f"shard {k}/{n} of {self.directory} holds no samples (of {total})")
        self.files = items
        self.max_bytes = _sample_bytes(inputs)

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, positions: Sequence[int]) -> Dataset:
        """The same reader over the samples at ``positions`` (of :attr:`files`) only."""
        part = copy.copy(self)
        part.files = [self.files[i] for i in positions]
        part.skipped = []
        return part

    def _read(self, path: Path) -> Feed:
        if self.format == "images":
            assert self.preprocess is not None  # set for images in __init__
            return {self.inputs[0].name: self.preprocess.apply(path)}
        if self.format == "onnx-test-data":
            return self._read_test_data_set(path)
        if self.format == "npy":
            name = self.decoder.input_ids if self.decoder else self.inputs[0].name
            return {name: read_npy(path, self.max_bytes)}
        return read_npz(path, self.max_bytes)

    def _read_test_data_set(self, directory: Path) -> Feed:
        """``input_<k>.pb`` TensorProto files; a tensor without a known name feeds input k."""

        def order(path: Path) -> tuple[int, str]:
            suffix = path.stem.rsplit("_", 1)[-1]
            return (int(suffix), "") if suffix.isdigit() else (1 << 30, path.name)

        files = sorted(directory.glob("input_*.pb"), key=order)
        if not files:
            raise QtoolError(f"{directory} holds no input_*.pb files")
        feed: Feed = {}
        names = [spec.name for spec in self.inputs]
        for position, path in enumerate(files):
            tensor = read_tensor_proto(path, self.max_bytes)
            array = tensor_values(tensor, path)
            name = tensor.name if tensor.name in names else names[position] if position < len(names) else tensor.name
            feed[name] = array
        return feed

    def _validate(self, path: Path, feed: Feed) -> Feed | None:
        expected = {spec.name for spec in self.inputs}
        extra = sorted(set(feed) - expected)
        if extra:  # one folder for several variants of a model: keys a model does not take are left out
            self._note_ignored(path, extra)
            feed = {name: array for name, array in feed.items() if name in expected}
        if self.decoder is not None and self.decoder.input_ids in feed:
            feed = self._completed_tokens(path, feed)
        missing = sorted(expected - set(feed))
        if missing:
            held = ", ".join(sorted(feed)) or "nothing"
            raise QtoolError(
                f"{path}: the sample has no {', '.join(repr(m) for m in missing)} "
                f"(the model takes {', '.join(sorted(expected))}; the sample holds {held})",
                hint="save one array per model input, each under the input's name",
            )
        out: Feed = {}
        for spec in self.inputs:
            array = feed[spec.name]
            if spec.shape is not None and array.ndim == len(spec.shape) - 1:
                array = array[np.newaxis]
            fits = spec.shape is None or (
                array.ndim == len(spec.shape)
                and all(
                    not isinstance(d, int) or d == actual for d, actual in zip(spec.shape, array.shape, strict=False)
                )
            )
            batch = spec.shape[0] if spec.shape else None
            rest_fits = spec.shape is not None and list(array.shape[1:]) == [
                actual if not isinstance(d, int) else d
                for d, actual in zip(spec.shape[1:], array.shape[1:], strict=False)
            ]
            if not fits and isinstance(batch, int) and batch > 1 and array.ndim == len(spec.shape or ()) and rest_fits:
                raise QtoolError(
                    f"{path}: input '{spec.name}' has a fixed batch of {batch}, the sample holds {array.shape[0]}",
                    hint=f"save {batch} samples stacked in each file (shape {[batch, *array.shape[1:]]}), "
                    "or export the model with a dynamic batch",
                )
            if not fits or array.dtype != spec.dtype:
                raise QtoolError(
                    f"{path}: input '{spec.name}' expects {spec.describe()}, "
                    f"got [{', '.join(map(str, feed[spec.name].shape))}] {feed[spec.name].dtype}",
                    hint="samples may leave out the batch dimension; save them with the model's dtype",
                )
            if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
                if self.skip_nonfinite:
                    log.info("%s: skipped, input '%s' holds NaN or Inf", path, spec.name)
                    self.skipped.append(path)
                    return None
                raise QtoolError(
                    f"{path}: input '{spec.name}' holds NaN or Inf values",
                    hint="fix the sample, or pass --skip-nonfinite to leave such samples out",
                )
            out[spec.name] = array
        return out

    def _completed_tokens(self, path: Path, feed: Feed) -> Feed:
        """A token file's feed with what a decoder's prefill needs besides its ids (see :func:`complete_feed`)."""
        assert self.decoder is not None  # the caller checks
        ids = np.asarray(feed[self.decoder.input_ids])
        if ids.size == 0:
            raise QtoolError(f"{path}: '{self.decoder.input_ids}' holds no token", hint="give each sample 1 or more")
        if ids.ndim not in (1, 2):
            raise QtoolError(
                f"{path}: '{self.decoder.input_ids}' has shape {list(ids.shape)}: token ids are [length] "
                "or [batch, length]",
                hint="save each sample's token ids as a 1-D or 2-D integer array",
            )
        return complete_feed(self.decoder, feed)

    def _note_ignored(self, path: Path, keys: list[str]) -> None:
        """Say once per dataset which sample keys the model does not take (they are left out; the log escapes names)."""
        if self._ignored_noted:
            return
        self._ignored_noted = True
        log.warning(
            "%s: keys %s are not inputs of this model: left out (here and in any other sample holding them)",
            path,
            ", ".join(keys),
        )

    def samples(self) -> Iterator[tuple[Path, Feed]]:
        """Yield (file, feed) for every usable sample, each with a batch dimension."""
        self.skipped = []
        for path in self.files:
            feed = self._validate(path, self._read(path))
            if feed is not None:
                yield path, feed

    def effective_batch_size(self, requested: int) -> int:
        """``requested`` when every input's batch dimension is dynamic, else 1 (with a note in the log)."""
        if requested > 1 and not all(spec.dynamic_batch for spec in self.inputs):
            log.warning("the model's batch dimension is fixed; calibrating with batch size 1")
            return 1
        return max(1, requested)

    def batches(self, batch_size: int = 1) -> Iterator[tuple[list[Path], Feed]]:
        """Yield (the sample files, feed), concatenating up to ``batch_size`` samples."""
        batch_size = self.effective_batch_size(batch_size)
        pending: list[Feed] = []
        paths: list[Path] = []
        for path, feed in self.samples():
            if pending and any(feed[k].shape[1:] != pending[0][k].shape[1:] for k in feed):
                # samples with other dynamic sizes cannot share a batch: run what is pending first
                yield paths, _concat(pending)
                pending, paths = [], []
            pending.append(feed)
            paths.append(path)
            if len(pending) == batch_size:
                yield paths, _concat(pending)
                pending, paths = [], []
        if pending:
            yield paths, _concat(pending)


def _concat(feeds: list[Feed]) -> Feed:
    if len(feeds) == 1:
        return feeds[0]
    return {name: np.concatenate([f[name] for f in feeds], axis=0) for name in feeds[0]}
