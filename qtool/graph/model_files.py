"""Which files a model is and what a file holds: its external data files, digests, sameness, text or not.

Reading a model (:mod:`qtool.graph.model_io`) and protecting a command's inputs both need to know the
files behind a model; a text file given where a model belongs is named for what it looks like.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import onnx

from qtool.errors import QtoolError


def check_not_text(path: Path) -> None:
    """Refuse a text file given as a model, saying what it looks like (statistics, a report, a config)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise QtoolError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        text = head.decode("utf-8").lstrip()
    except UnicodeDecodeError:
        return  # binary: the protobuf parser decides
    if not text or not all(c.isprintable() or c in "\r\n\t" for c in text[:512]):
        return
    if text.startswith(("{", "[")):
        kind = "qtool statistics (JSON)" if '"tensors"' in head.decode("utf-8", "replace") else "a JSON file"
        if '"schema_version"' in text:
            kind = "a qtool report (JSON)"
    elif text.startswith(("ir_version", "graph", "opset_import")):
        kind = "an ONNX model in text form (textproto)"
    else:
        kind = "a text file (a YAML config?)"
    raise QtoolError(
        f"{path} is not an ONNX model: it looks like {kind}",
        hint="give the .onnx model file here (statistics go to --stats, configs to --config)",
    )


def all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and tensor attributes (Constant values), subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from all_tensors(sub)


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The initializers (subgraphs' too) whose values live in an external data file."""
    return (t for t in all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL)


def file_sha256(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes; for a model, of its external data files too."""
    return files_sha256(model_files(path))


def files_sha256(files: list[Path]) -> str:
    """Hex SHA-256 of the bytes of ``files`` one after the other, read in chunks."""
    digest = hashlib.sha256()
    for part in files:
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_files(path: Path | str) -> list[Path]:
    """A model file followed by the external data files it names (just the file for anything else)."""
    return [Path(path), *_data_files(Path(path))]


# A model file this large holds its weights itself; parsing it just to list data files would cost its size in memory.
_SCAN_MAX_BYTES = 256 << 20


def _data_files(path: Path) -> list[Path]:
    """The external data files a model names that exist in its directory, in order of first use."""
    try:
        status = path.stat()
    except OSError:
        return []
    if not stat.S_ISREG(status.st_mode) or status.st_size > _SCAN_MAX_BYTES:  # a model may have any file name
        return []
    # A command lists its inputs' files before any work and again for its report: parse each version once.
    named = _named_data_files(path.resolve(), status.st_mtime_ns, status.st_size, status.st_ino)
    return [target for target in named if target.is_file()]


@lru_cache(maxsize=64)
def _named_data_files(path: Path, mtime_ns: int, size: int, inode: int) -> tuple[Path, ...]:
    with open(path, "rb") as f:
        if f.read(1) != b"\x08":  # a serialised ModelProto starts with ir_version (field 1, varint)
            return ()
    try:
        model = onnx.load(str(path), format="protobuf", load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model (a damaged one): it names no data files
        return ()
    base = path.parent
    found: dict[Path, None] = {}
    for tensor in external_tensors(model):
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (base / location).resolve()
        if location and target.is_relative_to(base) and target != path:
            found[target] = None
    return tuple(found)


def same_file(a: Path | str, b: Path | str) -> bool:
    """True when two paths name the same file (also through links)."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


@dataclass(frozen=True)
class ModelFile:
    """A model file on disk."""

    path: str
    size_bytes: int
    sha256: str

    @classmethod
    def of(cls, path: Path | str) -> ModelFile:
        """Size and digest of the model file and the external data files it names."""
        files = model_files(path)
        return cls(str(path), sum(f.stat().st_size for f in files), files_sha256(files))
