"""Large initializers held as numpy arrays outside the ModelProto ("detached" weights).

A protobuf message cannot exceed 2 GiB, and every copy of a ModelProto (preparing,
exposing tensors for calibration, rewriting) would copy all the weights. So the
values of large top-level initializers live once, in a :class:`Weights` store, and
the TensorProto keeps only its name, type and dims, marked as external data at
:data:`DETACHED_LOCATION`. Model copies are then cheap; onnxruntime gets the arrays
without a copy (:meth:`Weights.session_options`), and :func:`qtool.graph.model_io.save_model`
writes them back, embedded or as external data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.foreign_ops import park_unknown_ops
from qtool.graph.weight_files import MappedRegion, release

# Marks a detached tensor. onnxruntime checks that an external location exists even for an
# initializer the session options supply, and "." (the working directory) always does.
DETACHED_LOCATION = "."
DETACH_MIN_BYTES = 1 << 16  # smaller tensors stay in the protobuf: they cost nothing to copy

# Types whose raw bytes are plain little-endian numpy arrays (sub-byte and string types stay embedded).
_DETACHABLE = {
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.DOUBLE,
    TensorProto.INT8,
    TensorProto.UINT8,
    TensorProto.INT16,
    TensorProto.UINT16,
    TensorProto.INT32,
    TensorProto.UINT32,
    TensorProto.INT64,
    TensorProto.UINT64,
}


def detachable(tensor: TensorProto) -> bool:
    """True for a tensor type whose values :class:`Weights` can hold."""
    return tensor.data_type in _DETACHABLE


def numpy_dtype(tensor: TensorProto) -> np.dtype:
    """The little-endian numpy dtype of a detachable tensor's raw bytes."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")


def is_detached(tensor: TensorProto) -> bool:
    """True when ``tensor``'s values live in a :class:`Weights` store."""
    return (
        tensor.data_location == TensorProto.EXTERNAL
        and len(tensor.external_data) == 1
        and tensor.external_data[0].key == "location"
        and tensor.external_data[0].value == DETACHED_LOCATION
    )


def clear_values(tensor: TensorProto) -> None:
    """Drop ``tensor``'s values (embedded or external), keeping its name, type and dims."""
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "external_data"):
        tensor.ClearField(name)


def mark_detached(tensor: TensorProto) -> None:
    """Drop ``tensor``'s values from the protobuf, keeping its name, type and dims."""
    clear_values(tensor)
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", DETACHED_LOCATION


@dataclass
class Weights:
    """The detached initializer values of one model (and of the models derived from it), by name."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    regions: dict[str, MappedRegion] = field(default_factory=dict)  # values still mapped from a data file

    def release(self, names: list[str] | None = None) -> None:
        """Give back the memory of mapped values (all of them by default): they are read from the file again if used.

        Only pages of the input's data files are dropped; values computed in memory stay.
        """
        for name in self.regions if names is None else [n for n in names if n in self.regions]:
            release(self.regions[name])

    def value(self, tensor: TensorProto) -> np.ndarray:
        """The values of an initializer, detached or not."""
        if is_detached(tensor):
            return self.arrays[tensor.name]
        return numpy_helper.to_array(tensor)

    def replace(self, tensor: TensorProto, values: np.ndarray) -> None:
        """Give ``tensor`` new values, keeping them detached when they were."""
        if is_detached(tensor):
            self.arrays[tensor.name] = values
            del tensor.dims[:]
            tensor.dims.extend(values.shape)
        else:
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))

    def detach(self, graph: onnx.GraphProto, min_bytes: int = DETACH_MIN_BYTES) -> int:
        """Move the values of ``graph``'s large initializers into this store; returns how many moved.

        The graph's message keeps its memory until it is copied or freed (protobuf arenas
        do not shrink): load and detach before making the copy that is kept.
        """
        moved = 0
        for tensor in graph.initializer:
            if is_detached(tensor) or not detachable(tensor) or tensor.data_location == TensorProto.EXTERNAL:
                continue
            if _embedded_bytes(tensor) < min_bytes:
                continue
            self.arrays[tensor.name] = numpy_helper.to_array(tensor)
            mark_detached(tensor)
            moved += 1
        return moved

    def retain(self, model: onnx.ModelProto) -> None:
        """Free the values ``model`` does not use (models derived from the same store lose them too)."""
        used = {tensor.name for tensor, _ in self.detached_in(model)}
        for name in [n for n in self.arrays if n not in used]:
            del self.arrays[name]
            region = self.regions.pop(name, None)
            if region is not None:
                release(region)

    def detached_in(self, model: onnx.ModelProto) -> Iterator[tuple[TensorProto, np.ndarray]]:
        """The detached initializers ``model`` has, with their values."""
        for tensor in model.graph.initializer:
            if is_detached(tensor):
                yield tensor, self.arrays[tensor.name]

    def nbytes(self, model: onnx.ModelProto) -> int:
        """Bytes of the detached values ``model`` uses."""
        return sum(values.nbytes for _, values in self.detached_in(model))

    def session_options(
        self, model: onnx.ModelProto, options: ort.SessionOptions, *, copy: bool = False
    ) -> list[ort.OrtValue]:
        """Hand ``model``'s detached values to onnxruntime; the returned OrtValues must outlive the session.

        By default onnxruntime uses the arrays in place, with weight prepacking turned off as it
        would copy every weight again; ``copy=True`` lets onnxruntime copy them instead (the
        fallback for an onnxruntime that refuses the shared ones).
        """
        values = [
            (tensor.name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array)))
            for tensor, array in self.detached_in(model)
        ]
        if copy and values:
            options.add_external_initializers([name for name, _ in values], [value for _, value in values])
        elif values:
            for name, value in values:
                options.add_initializer(name, value)
            options.add_session_config_entry("session.disable_prepacking", "1")
        return [value for _, value in values]

    def embedded(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of ``model`` with every detached value written back into the protobuf."""
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        for tensor in copy.graph.initializer:
            if is_detached(tensor):
                tensor.ClearField("external_data")
                tensor.ClearField("data_location")
                tensor.raw_data = self.arrays[tensor.name].astype(numpy_dtype(tensor), copy=False).tobytes()
        return copy

    def embedded_size(self, model: onnx.ModelProto) -> int:
        """The byte size of :meth:`embedded` ``(model)``, computed without copying any value."""
        graph_delta = 0
        for tensor in model.graph.initializer:
            if not is_detached(tensor):
                continue
            bare = TensorProto()
            bare.CopyFrom(tensor)
            bare.ClearField("external_data")
            bare.ClearField("data_location")
            length = self.arrays[tensor.name].nbytes
            embedded = bare.ByteSize() + 1 + _varint_size(length) + length  # raw_data is field 9: a 1-byte tag
            old = tensor.ByteSize()
            graph_delta += embedded + _varint_size(embedded) - old - _varint_size(old)
        graph = model.graph.ByteSize()
        return model.ByteSize() + graph_delta + _varint_size(graph + graph_delta) - _varint_size(graph)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _embedded_bytes(tensor: TensorProto) -> int:
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    return count * numpy_dtype(tensor).itemsize


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` for onnx's checker: large and detached initializers become typed graph inputs.

    The checker insists that external data exists on disk, and copies the model several times
    over; as graph inputs of the same type and shape, the initializers type-check exactly as
    before, without their values.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    park_unknown_ops(copy)  # ops only onnxruntime knows (see qtool.graph.foreign_ops) stay unchecked
    graph = copy.graph
    moved = [
        t for t in graph.initializer if is_detached(t) or (detachable(t) and _embedded_bytes(t) >= DETACH_MIN_BYTES)
    ]
    if not moved:
        return copy
    names = {t.name for t in moved}
    kept = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    return copy
