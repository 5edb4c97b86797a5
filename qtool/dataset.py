"""Iterate a dataset directory lazily into onnxruntime input feeds.

Supported layouts (auto-detected): ``*.npy`` files, one sample each, for
single-input models; ``*.npz`` files whose keys are the model's input names.
Samples may include the batch dimension or leave it out. Files are read one at
a time, in sorted order, so memory never holds the whole dataset.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from qtool.errors import QtoolError

log = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
Dim = int | str | None


@dataclass(frozen=True)
class InputSpec:
    """A model input: name, numpy dtype and shape (str/None for dynamic dimensions)."""

    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...]

    @property
    def dynamic_batch(self) -> bool:
        return bool(self.shape) and not isinstance(self.shape[0], int)

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"[{dims}] {self.dtype}"


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed (graph inputs that are not initializers)."""
    initializers = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type") or tensor_type.elem_type == TensorProto.UNDEFINED:
            raise QtoolError(f"model input '{value.name}' is not a tensor of a known type; qtool can only feed tensors")
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        except (KeyError, TypeError) as e:
            name = TensorProto.DataType.Name(tensor_type.elem_type)
            raise QtoolError(f"model input '{value.name}' has type {name}, which numpy samples cannot hold") from e
        dims: list[Dim] = []
        for d in tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            else:
                dims.append(d.dim_param or None)
        specs.append(InputSpec(value.name, dtype, tuple(dims)))
    return specs


class Dataset:
    """A directory of samples, validated against a model's inputs and read lazily.

    Args:
        directory: the dataset directory.
        inputs: the model's inputs (see :func:`model_inputs`).
        limit: use only the first ``limit`` files (sorted by name).
    """

    def __init__(self, directory: Path | str, inputs: list[InputSpec], limit: int | None = None) -> None:
        self.directory = Path(directory)
        self.inputs = inputs
        if not self.directory.exists():
            raise QtoolError(f"data directory not found: {self.directory}")
        if not self.directory.is_dir():
            raise QtoolError(f"{self.directory} is not a directory")
        npy = sorted(self.directory.glob("*.npy"))
        npz = sorted(self.directory.glob("*.npz"))
        if npy and npz:
            raise QtoolError(f"{self.directory} mixes .npy and .npz files", hint="keep one format per directory")
        files = npy or npz
        if not files:
            raise QtoolError(f"data directory {self.directory} holds no samples (*.npy or *.npz files)")
        if npy and len(inputs) != 1:
            names = ", ".join(i.name for i in inputs)
            raise QtoolError(
                f"{self.directory}: .npy samples only fit single-input models, this model has inputs {names}",
                hint="store each sample as an .npz file whose keys are the input names",
            )
        self.files = files[:limit] if limit else files

    def __len__(self) -> int:
        return len(self.files)

    def _read(self, path: Path) -> Feed:
        try:
            if path.suffix == ".npy":
                return {self.inputs[0].name: np.load(path, allow_pickle=False)}
            with np.load(path, allow_pickle=False) as archive:
                return {key: archive[key] for key in archive.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise QtoolError(f"{path}: cannot read sample: {e}") from e

    def _validate(self, path: Path, feed: Feed) -> Feed:
        expected = {spec.name for spec in self.inputs}
        missing, extra = expected - set(feed), set(feed) - expected
        if missing or extra:
            raise QtoolError(
                f"{path}: sample keys {sorted(feed)} do not match the model inputs {sorted(expected)}",
                hint="name each array in the .npz file after a model input",
            )
        out: Feed = {}
        for spec in self.inputs:
            array = feed[spec.name]
            if array.ndim == len(spec.shape) - 1:
                array = array[np.newaxis]
            fits = array.ndim == len(spec.shape) and all(
                not isinstance(d, int) or d == actual for d, actual in zip(spec.shape, array.shape, strict=False)
            )
            if not fits or array.dtype != spec.dtype:
                raise QtoolError(
                    f"{path}: input '{spec.name}' expects {spec.describe()}, "
                    f"got [{', '.join(map(str, feed[spec.name].shape))}] {feed[spec.name].dtype}",
                    hint="samples may leave out the batch dimension; save them with the model's dtype",
                )
            out[spec.name] = array
        return out

    def samples(self) -> Iterator[tuple[Path, Feed]]:
        """Yield (file, feed) for every sample, each with a batch dimension."""
        for path in self.files:
            yield path, self._validate(path, self._read(path))

    def effective_batch_size(self, requested: int) -> int:
        """``requested`` when every input's batch dimension is dynamic, else 1 (with a note in the log)."""
        if requested > 1 and not all(spec.dynamic_batch for spec in self.inputs):
            log.info("the model's batch dimension is fixed; calibrating with batch size 1")
            return 1
        return max(1, requested)

    def batches(self, batch_size: int = 1) -> Iterator[tuple[int, Feed]]:
        """Yield (number of samples, feed), concatenating up to ``batch_size`` samples."""
        batch_size = self.effective_batch_size(batch_size)
        pending: list[Feed] = []
        for _, feed in self.samples():
            pending.append(feed)
            if len(pending) == batch_size:
                yield len(pending), _concat(pending)
                pending = []
        if pending:
            yield len(pending), _concat(pending)


def _concat(feeds: list[Feed]) -> Feed:
    if len(feeds) == 1:
        return feeds[0]
    return {name: np.concatenate([f[name] for f in feeds], axis=0) for name in feeds[0]}
