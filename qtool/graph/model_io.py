"""Load, fingerprint and atomically save ONNX models and other outputs."""

from __future__ import annotations

import glob
import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import external_data_helper, numpy_helper

from qtool.errors import QtoolError
from qtool.graph.model_files import all_tensors, check_not_text, external_tensors
from qtool.graph.weight_files import FileMaps, mappable
from qtool.graph.weights import (
    DETACH_MIN_BYTES,
    Weights,
    clear_values,
    detachable,
    is_detached,
    mark_detached,
    numpy_dtype,
)
from qtool.system.outputs import ENVIRONMENT_ERRNOS, after_commit, environment_error, finish, is_protected


def load_model(path: Path | str, weights: Weights | None = None) -> onnx.ModelProto:
    """Read an ONNX model, with a clear error for missing, empty or non-ONNX files.

    With ``weights``, large initializers (embedded or external) go into that store instead
    of the protobuf (see :mod:`qtool.graph.weights`); external data is then read straight into
    numpy arrays, so a model over 2 GiB never becomes one protobuf message.

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
    check_not_text(path)
    try:
        # always the binary format: onnx would otherwise pick a JSON or text parser from the file's extension
        model = onnx.load(str(path), format="protobuf", load_external_data=False)
    except OSError as e:
        raise QtoolError(f"cannot read {path}: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever protobuf raises on bytes that are not a model: exit 2
        raise QtoolError(f"{path} is not a valid ONNX model: {type(e).__name__}: {e}") from None
    # Random bytes can decode as an (almost) empty protobuf message.
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph") or not model.graph.node:
        raise QtoolError(f"{path} is not an ONNX model (no IR version, opset or graph nodes found)")
    if model.ir_version > onnx.IR_VERSION:
        raise QtoolError(
            f"{path} has ONNX IR version {model.ir_version}, newer than onnx {onnx.__version__} reads "
            f"(IR version {onnx.IR_VERSION} at most)",
            hint="upgrade onnx and onnxruntime, or export the model with an older onnx",
        )
    _check_decoded(model, path)
    _load_external_data(model, path, weights)
    if weights is not None and weights.detach(model.graph):
        slim = onnx.ModelProto()  # a fresh message: the parsed one keeps the detached bytes until freed
        slim.CopyFrom(model)
        return slim
    return model


def tensor_names(path: Path | str) -> list[str]:
    """The names of a model's graph inputs and node outputs (its weights left where they are)."""
    model = load_model(path, Weights())
    names = [value.name for value in model.graph.input]
    names += [name for node in model.graph.node for name in node.output if name]
    return names


def _check_decoded(model: onnx.ModelProto, path: Path) -> None:
    """Refuse what protobuf decodes without complaint: text that is not UTF-8, tensors at odds with their dims.

    Both come from damaged or hostile files and would otherwise fail deep inside a later stage. Each
    embedded tensor is read the way every later stage reads it, which costs no more than its bytes:
    a tensor claiming dims of 2**40 x 2**40 with 16 bytes of data fails the reshape, it allocates nothing.
    """
    field = _non_utf8_field(model)
    if field is not None:
        raise QtoolError(f"{path} is not a valid ONNX model: its field {field} is not UTF-8 text")
    names = [t.name for t in model.graph.initializer]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise QtoolError(f"{path} is not a valid ONNX model: two initializers are named '{twice}'")
    for tensor in all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue  # checked against its data file when that is read
        known = tensor.data_type in onnx.TensorProto.DataType.values()
        dtype = onnx.TensorProto.DataType.Name(tensor.data_type) if known else f"unknown type {tensor.data_type}"
        where = f"{path}: tensor '{tensor.name}' ({dtype}, dims {list(tensor.dims)})"
        if any(d < 0 for d in tensor.dims):
            raise QtoolError(f"{where} has a negative dimension", hint="the file is damaged; export the model again")
        try:
            numpy_helper.to_array(tensor)
        except (ValueError, TypeError, KeyError) as e:  # size mismatch, undefined or unknown data type
            raise QtoolError(
                f"{where} does not hold the data its dims and type claim: {e}",
                hint="the file is damaged; export the model again",
            ) from e


def _non_utf8_field(message: Any) -> str | None:
    """The path of the first text field in ``message`` (recursively) that is not UTF-8.

    protobuf hands such a field over as ``bytes`` instead of ``str``; bytes fields are never read here.
    """
    # Whether a field is repeated is read off its value: protobuf 7 dropped FieldDescriptor.label.
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING:
            value = getattr(message, field.name)
            if any(isinstance(item, bytes) for item in ([value] if isinstance(value, (str, bytes)) else value)):
                return field.name
        elif field.type == field.TYPE_MESSAGE:
            value = getattr(message, field.name)
            if isinstance(value, Message):  # a single message, walked only when set: defaults nest without end
                value = [value] if message.HasField(field.name) else []
            for item in value:
                inner = _non_utf8_field(item)
                if inner is not None:
                    return f"{field.name}.{inner}"
    return None


def _load_external_data(model: onnx.ModelProto, path: Path, weights: Weights | None) -> None:
    """Read tensors stored beside the model, refusing locations outside the model's directory.

    A model from someone else must not make qtool read ``/etc/shadow`` or ``../../secrets`` into
    the quantized output: absolute locations, ``..`` and symlinks that leave the directory are refused.
    Large top-level initializers go straight into ``weights`` when it is given.
    """
    base = path.parent.resolve()
    if weights is not None:
        maps = FileMaps()
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL or not detachable(tensor):
                continue
            target, offset, length = _external_location(tensor, base, path)
            if length >= DETACH_MIN_BYTES:
                _check_length(tensor, length, path)
                dtype, shape = numpy_dtype(tensor), tuple(tensor.dims)
                if mappable(offset, dtype):
                    weights.arrays[tensor.name], weights.regions[tensor.name] = maps.array(target, offset, dtype, shape)
                else:
                    weights.arrays[tensor.name] = _read_array(tensor, target, offset, length, path)
                mark_detached(tensor)
    for tensor in external_tensors(model):
        if is_detached(tensor):
            continue
        _external_location(tensor, base, path)
        try:
            external_data_helper.load_external_data_for_tensor(tensor, str(base))
        except (OSError, ValueError) as e:
            raise QtoolError(f"cannot read the external data of tensor '{tensor.name}' of {path}: {e}") from e
        # As if it had been embedded: same bytes out, whichever way the model was saved.
        tensor.ClearField("data_location")
        tensor.ClearField("external_data")


def _external_location(tensor: onnx.TensorProto, base: Path, path: Path) -> tuple[Path, int, int]:
    """The checked file, offset and length of an external tensor's data."""
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
    try:
        offset = int(entries.get("offset") or 0)
        length = int(entries["length"]) if entries.get("length") else size - offset
    except ValueError as e:
        raise QtoolError(f"{where} with an offset or length that is not a number") from e
    if offset < 0 or length < 0 or offset + length > size:
        raise QtoolError(f"{where} (offset {offset}, length {length}), beyond the file's {size} bytes")
    return target, offset, length


def _check_length(tensor: onnx.TensorProto, length: int, path: Path) -> None:
    """Refuse an external tensor whose data length does not match its dims."""
    dtype = numpy_dtype(tensor)
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    if any(d < 0 for d in tensor.dims) or count * dtype.itemsize != length:
        raise QtoolError(
            f"{path}: tensor '{tensor.name}' claims dims {list(tensor.dims)} ({dtype.name}) "
            f"but its external data holds {length} bytes"
        )


def _read_array(tensor: onnx.TensorProto, target: Path, offset: int, length: int, path: Path) -> np.ndarray:
    """Read an external tensor into a numpy array, checking its length against its dims."""
    _check_length(tensor, length, path)
    dtype = numpy_dtype(tensor)
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    with open(target, "rb") as f:
        f.seek(offset)
        values = np.fromfile(f, dtype=dtype, count=count)
    return values.reshape(tuple(tensor.dims))


def _chmod_like_new_file(path: Path) -> None:
    """Give ``path`` the permissions any new file would get (mkstemp creates 0600 files)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextmanager
def atomic_writer(path: Path | str, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write to a temporary file next to ``path``; fsync and rename it into place on success.

    Inside a :func:`qtool.system.outputs.transaction` the rename waits for the transaction's commit. If
    the block raises (or the process is interrupted), the temporary file is removed and ``path`` is
    left as it was. Disk full, read-only folders and missing permissions are the user's to fix:
    they raise QtoolError naming ``path``.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise QtoolError(f"output directory does not exist: {directory}")
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        tmp = Path(name)
        _chmod_like_new_file(tmp)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        finish(tmp, path)
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if e.errno in ENVIRONMENT_ERRNOS:
            raise environment_error(e, "write", path) from e
        raise
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


# Protobuf refuses messages over 2 GiB; past this size the weights are written to a data file beside the model.
EMBED_MAX_BYTES = (2 << 30) - (64 << 20)
EXTERNAL_MIN_BYTES = 1024  # tensors at least this large go to the data file; smaller ones stay in the model
_ALIGN = 4096  # data file offsets are page aligned, so onnxruntime can map the tensors


def save_model(
    model: onnx.ModelProto, path: Path | str, weights: Weights | None = None, *, external: bool | None = None
) -> list[Path]:
    """Serialise a model deterministically and write it atomically; returns the files written.

    Args:
        model: the model; its detached initializers take their values from ``weights``.
        path: the ``.onnx`` file to write.
        weights: the store of ``model``'s detached values (see :mod:`qtool.graph.weights`).
        external: True to write tensors to a data file beside the model, False to embed them,
            None to use a data file only when the model would exceed protobuf's 2 GiB limit.

    Raises:
        QtoolError: the model must be embedded but exceeds 2 GiB, or the output cannot be written.
    """
    path = Path(path)
    weights = weights or Weights()
    size = model.ByteSize() + weights.nbytes(model)
    if external is None:
        external = size > EMBED_MAX_BYTES
    if not external:
        if size > EMBED_MAX_BYTES:
            raise QtoolError(
                f"{path}: the model holds {size / 2**30:.2f} GiB, over protobuf's 2 GiB limit",
                hint="write it with external data",
            )
        data = weights.embedded(model).SerializeToString(deterministic=True)
        with atomic_writer(path) as f:
            f.write(data)
        after_commit(lambda: _remove_stale_data_files(path, keep=None))
        return [path]
    return _save_with_external_data(model, path, weights)


def _save_with_external_data(model: onnx.ModelProto, path: Path, weights: Weights) -> list[Path]:
    """Write tensors to ``<model>.<digest>.data`` and the graph to ``path``, both atomically.

    The data file is named by its content, so it is in place before the model that refers to
    it is renamed into place: an interrupted save leaves the previous output whole.
    """
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    pending = "qtool-pending.data"  # the real name depends on the content, known once written
    directory = path.parent if str(path.parent) else Path(".")
    tmp: Path | None = None
    digest = hashlib.sha256()
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".data.tmp", dir=directory)
        tmp = Path(name)
        with os.fdopen(fd, "wb") as f:
            offset = 0
            for tensor in skeleton.graph.initializer:
                data = _tensor_bytes(tensor, weights)
                if data is None or len(data) < EXTERNAL_MIN_BYTES:
                    continue
                padding = -offset % _ALIGN
                f.write(b"\0" * padding)
                digest.update(b"\0" * padding)
                offset += padding
                f.write(data)
                digest.update(data)
                clear_values(tensor)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", pending), ("offset", str(offset)), ("length", str(len(data)))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
                offset += len(data)
            f.flush()
            os.fsync(f.fileno())
        data_path = path.with_name(f"{path.name}.{digest.hexdigest()[:16]}.data")
        for tensor in skeleton.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value == pending:
                    entry.value = data_path.name
        _chmod_like_new_file(tmp)
        finish(tmp, data_path)  # staged before the model: committed first
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if e.errno in ENVIRONMENT_ERRNOS:
            raise environment_error(e, "write", path.with_name(path.name + ".<digest>.data")) from e
        raise
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    with atomic_writer(path) as f:
        f.write(skeleton.SerializeToString(deterministic=True))
    after_commit(lambda: _remove_stale_data_files(path, keep=data_path))
    return [path, data_path]


def _tensor_bytes(tensor: onnx.TensorProto, weights: Weights) -> bytes | None:
    """The raw little-endian bytes of an initializer's values; None when it has none to move."""
    if is_detached(tensor):
        return weights.arrays[tensor.name].astype(numpy_dtype(tensor), copy=False).tobytes()
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    if tensor.data_location == onnx.TensorProto.EXTERNAL or not detachable(tensor):
        return None
    return numpy_helper.to_array(tensor).astype(numpy_dtype(tensor), copy=False).tobytes()


def _remove_stale_data_files(path: Path, keep: Path | None) -> None:
    """Delete data files an earlier save of ``path`` wrote (its name, a 16-digit digest, .data)."""
    for old in path.parent.glob(f"{glob.escape(path.name)}.*.data"):
        digest = old.name[len(path.name) + 1 : -len(".data")]
        if old != keep and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest):
            if is_protected(old):  # named like ours, but an input of this command reads it
                continue
            old.unlink(missing_ok=True)


def write_text(path: Path | str, text: str) -> None:
    """Write a text file atomically."""
    with atomic_writer(path, "w") as f:
        f.write(text)
