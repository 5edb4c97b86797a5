"""A model compare reads, already open: ``quantize`` compares what it holds without reading the files again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from qtool.graph.model_files import ModelFile
from qtool.graph.model_io import load_model
from qtool.graph.session import create_session


@dataclass(frozen=True)
class OpenedModel:
    """A model compare reads, already open: its file, its graph and where its CPU session is made from.

    ``quantize`` compares the models it holds (the input as read, the output as written) without
    reading either again; its graphs' large weights are detached, so a per-layer comparison, which
    runs them whole, reads the files (see :meth:`whole`).
    """

    path: Path
    file: ModelFile  # size and digest of the file and its data files
    graph: onnx.ModelProto
    # makes its CPU session at the given threads from what is held (None: from the file)
    held: Callable[[int | None], ort.InferenceSession] | None = None
    detached: bool = False  # the graph's large weights live elsewhere: only the file runs it whole

    @classmethod
    def read(cls, path: Path | str) -> OpenedModel:
        """The model file at ``path``, loaded whole."""
        return cls(Path(path), ModelFile.of(path), load_model(path))

    def whole(self) -> OpenedModel:
        """The model with its weights in its graph (read from its file when they are detached)."""
        return OpenedModel.read(self.path) if self.detached else self

    def cpu_session(self, threads: int | None) -> ort.InferenceSession:
        """Its session on the CPU provider, made from what is held (else from the file)."""
        if self.held is not None:
            return self.held(threads)
        return create_session(self.path, str(self.path), threads=threads)
