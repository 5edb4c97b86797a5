"""Reading one sample file (.npy, .npz, TensorProto .pb) without trusting what it declares.

A ``.npy`` header can claim terabytes, an ``.npz`` can be a zip bomb or hold members that are not
arrays, a ``.pb`` can point at external files: sizes are checked against the file and
:data:`SAMPLE_MAX_BYTES` before anything is allocated, and every failure is one QtoolError naming
the file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import IO

import numpy as np
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.system.files import check_regular, read_bytes

SAMPLE_MAX_BYTES = 4 << 30  # one sample's arrays, uncompressed: far above any real input


def _limit(max_bytes: int | None) -> int:
    """The byte limit for one sample: what the model's inputs can hold, never over :data:`SAMPLE_MAX_BYTES`."""
    return SAMPLE_MAX_BYTES if max_bytes is None else min(max_bytes, SAMPLE_MAX_BYTES)


def _array_from(stream: IO[bytes], path: str, available: int, limit: int) -> np.ndarray:
    """Read one ``.npy`` array from ``stream`` after checking its header against ``available`` bytes."""
    try:
        version = np.lib.format.read_magic(stream)
        shape, fortran, dtype = (
            np.lib.format.read_array_header_1_0(stream)
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0(stream)
        )
    except (ValueError, OSError, EOFError) as e:
        raise QtoolError(f"{path}: not a .npy array ({e})") from e
    if dtype.hasobject:
        raise QtoolError(f"{path}: holds Python objects; samples must be numeric arrays")
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    header = stream.tell()
    if declared > limit:
        raise QtoolError(f"{path}: declares {declared:,} bytes, more than the model's inputs take ({limit:,} at most)")
    if declared != available - header:
        raise QtoolError(f"{path}: declares {declared:,} bytes of data but holds {available - header:,}")
    buffer = bytearray(declared)
    view, done = memoryview(buffer), 0
    while done < declared:
        got = stream.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            raise QtoolError(f"{path}: ends after {done:,} of {declared:,} bytes")
        done += got
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def read_npy(path: Path, max_bytes: int | None = None) -> np.ndarray:
    """One ``.npy`` file of at most ``max_bytes`` of array data."""
    limit = _limit(max_bytes)
    size = check_regular(path, "sample", limit + (1 << 20))
    try:
        with open(path, "rb") as stream:
            return _array_from(stream, str(path), size, limit)
    except OSError as e:
        raise QtoolError(f"cannot read sample {path}: {e.strerror or e}") from e


def read_npz(path: Path, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """An ``.npz`` archive: ``.npy`` members only, stored or deflated, of bounded declared size."""
    limit = _limit(max_bytes)
    check_regular(path, "sample", limit + (1 << 20))
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            total = sum(m.file_size for m in members)
            if total > limit + (1 << 20):
                raise QtoolError(f"{path}: unpacks to {total:,} bytes, more than the model's inputs take ({limit:,})")
            arrays: dict[str, np.ndarray] = {}
            for member in members:
                where = f"{path}: member {member.filename!r}"
                if not member.filename.endswith(".npy"):
                    raise QtoolError(f"{where} is not a .npy array", hint="save samples with numpy.savez")
                if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                    raise QtoolError(f"{where} uses zip compression method {member.compress_type}; use numpy.savez")
                with archive.open(member) as stream:
                    arrays[member.filename[: -len(".npy")]] = _array_from(stream, where, member.file_size, limit)
            return arrays
    except QtoolError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise QtoolError(f"{path}: cannot read sample archive: {e}") from e


def read_tensor_proto(path: Path, max_bytes: int | None = None) -> TensorProto:
    """A serialised TensorProto with its values in the file (never in external files)."""
    data = read_bytes(path, "sample", _limit(max_bytes) + (1 << 20))
    tensor = TensorProto()
    try:
        tensor.ParseFromString(data)
    except DecodeError as e:
        raise QtoolError(f"{path}: not a TensorProto: {e}") from e
    if tensor.data_location == TensorProto.EXTERNAL or tensor.external_data:
        raise QtoolError(f"{path}: the tensor refers to external data; sample tensors must hold their values")
    try:
        helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except KeyError:
        raise QtoolError(f"{path}: unknown tensor data_type {tensor.data_type}") from None
    return tensor


def tensor_values(tensor: TensorProto, path: Path) -> np.ndarray:
    """The tensor's values, refused when its dims do not match the data it holds."""
    if any(d < 0 for d in tensor.dims):
        raise QtoolError(f"{path}: negative dimension in {list(tensor.dims)}")
    try:
        return numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError) as e:
        raise QtoolError(f"{path}: tensor values do not match its dims {list(tensor.dims)}: {e}") from e
