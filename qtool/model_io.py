"""Load, fingerprint and atomically save ONNX models and other outputs."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from qtool.errors import QtoolError


def load_model(path: Path | str) -> onnx.ModelProto:
    """Read an ONNX model, with a clear error for missing, empty or non-ONNX files.

    Raises:
        QtoolError: the file cannot be read or does not hold an ONNX model.
    """
    path = Path(path)
    if not path.exists():
        raise QtoolError(f"model file not found: {path}")
    if path.is_dir():
        raise QtoolError(f"{path} is a directory, not an ONNX model file")
    if path.stat().st_size == 0:
        raise QtoolError(f"{path} is empty (0 bytes), not an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise QtoolError(f"{path} is not a valid ONNX model: {e}") from e
    except OSError as e:
        raise QtoolError(f"cannot read {path}: {e}") from e
    # Random bytes can decode as an (almost) empty protobuf message.
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph") or not model.graph.node:
        raise QtoolError(f"{path} is not an ONNX model (no IR version, opset or graph nodes found)")
    _load_external_data(model, path)
    return model


def _all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and tensor attributes (Constant values), subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_tensors(sub)


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    return (t for t in _all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL)


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read tensors stored beside the model, refusing locations outside the model's directory.

    A model from someone else must not make qtool read ``/etc/shadow`` or ``../../secrets`` into
    the quantized output: absolute locations, ``..`` and symlinks that leave the directory are refused.
    """
    base = path.parent.resolve()
    external = list(_external_tensors(model))
    for tensor in external:
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        where = f"{path}: tensor '{tensor.name}' has external data at '{location}'"
        if not location or Path(location).is_absolute() or ".." in Path(location).parts:
            raise QtoolError(f"{where}, which is outside the model's directory; refused")
        target = (base / location).resolve()
        if not target.is_relative_to(base):
            raise QtoolError(f"{where}, a link leading outside the model's directory ({target}); refused")
        if not target.is_file():
            raise QtoolError(f"{where}, which does not exist", hint="copy the data file next to the model")
        size = target.stat().st_size
        offset, length = int(entries.get("offset", 0) or 0), int(entries.get("length", 0) or 0)
        if offset < 0 or length < 0 or offset + length > size:
            raise QtoolError(f"{where} (offset {offset}, length {length}), beyond the file's {size} bytes")
    if not external:
        return
    try:
        external_data_helper.load_external_data_for_model(model, str(base))
    except (OSError, ValueError) as e:
        raise QtoolError(f"cannot read the external data of {path}: {e}") from e
    for tensor in external:  # as if it had been embedded: same bytes out, whichever way the model was saved
        tensor.ClearField("data_location")


def file_sha256(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_size_bytes(path: Path | str) -> int:
    """On-disk size of a model file."""
    return Path(path).stat().st_size


def same_file(a: Path | str, b: Path | str) -> bool:
    """True when two paths name the same file (also through links)."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


@contextmanager
def atomic_writer(path: Path | str, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write to a temporary file next to ``path``; fsync and rename it into place on success.

    If the block raises (or the process is interrupted), the temporary file is
    removed and ``path`` is left as it was.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise QtoolError(f"output directory does not exist: {directory}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        # mkstemp creates 0600 files; give the result the permissions any new file would get.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model(model: onnx.ModelProto, path: Path | str) -> None:
    """Serialise a model deterministically and write it atomically."""
    data = model.SerializeToString(deterministic=True)
    with atomic_writer(path) as f:
        f.write(data)


def write_text(path: Path | str, text: str) -> None:
    """Write a text file atomically."""
    with atomic_writer(path, "w") as f:
        f.write(text)
