"""``--input-shapes name:1x3x640x640,...``: fix a model's dynamic input dimensions for qtool's work.

With the dimensions other than batch fixed, shape inference sizes every tensor, so ``placement:
auto`` decides from the work each node does even without data, and samples of another shape are
refused with the input's name instead of being calibrated or timed at a shape nobody ships. The
batch dimension keeps the model's own (symbolic batches stay batchable). The quantized model is
written with the input dimensions of the model it came from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import onnx

from qtool.errors import QtoolError

_ENTRY = re.compile(r"^\s*([^:]+?)\s*:\s*(\d+(?:\s*[xX]\s*\d+)*)\s*$")
MAX_DIM = 2**31 - 1  # onnxruntime sizes tensors with 64-bit integers, but no real input dimension comes near
MAX_ELEMENTS = 2**30  # per input: 4 GiB of float32 for one sample, before any tensor behind it
MAX_RANK = 16


def parse_input_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """``"ids:1x128,mask:1x128"`` -> ``{"ids": (1, 128), "mask": (1, 128)}``.

    Raises:
        QtoolError: an entry that is not ``name:AxBx...`` with positive integers, or a name given twice.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for entry in (part for part in text.split(",") if part.strip()):
        match = _ENTRY.match(entry)
        if match is None or any(int(d) <= 0 for d in re.split(r"\s*[xX]\s*", match[2])):
            raise QtoolError(
                f"--input-shapes entry '{entry.strip()}' is not name:AxBx... with positive sizes",
                hint="for example images:1x3x640x640,mask:1x640x640",
            )
        name = match[1]
        if name in shapes:
            raise QtoolError(f"--input-shapes names input '{name}' twice")
        shapes[name] = _bounded(name, [d.lstrip("0") or "0" for d in re.split(r"\s*[xX]\s*", match[2])])
    if not shapes:
        raise QtoolError("--input-shapes is empty", hint="for example images:1x3x640x640")
    return shapes


def _bounded(name: str, digits: list[str]) -> tuple[int, ...]:
    """The sizes of one entry, each and together within what one sample can take (checked before any allocation)."""
    if len(digits) > MAX_RANK:
        raise QtoolError(f"--input-shapes: input '{name}' has {len(digits)} dimensions, more than {MAX_RANK}")
    if any(len(d) > len(str(MAX_DIM)) or int(d) > MAX_DIM for d in digits):
        raise QtoolError(f"--input-shapes: a size of input '{name}' is over {MAX_DIM:,}")
    dims = tuple(int(d) for d in digits)
    elements = 1
    for dim in dims:
        elements *= dim
    if elements > MAX_ELEMENTS:
        raise QtoolError(
            f"--input-shapes: input '{name}' would hold {elements:,} values per sample, more than {MAX_ELEMENTS:,}",
            hint="give the sizes the model ships with",
        )
    return dims


def fix_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], source: str) -> None:
    """Set the given inputs' dimensions (all but a symbolic batch) in ``model``, in place.

    Raises:
        QtoolError: an unknown input, another rank, or a size that contradicts a fixed one of the model.
    """
    inputs = {value.name: value for value in model.graph.input}
    initializers = {init.name for init in model.graph.initializer}
    for name, dims in shapes.items():
        value = inputs.get(name)
        if value is None or name in initializers:
            known = ", ".join(n for n in inputs if n not in initializers)
            raise QtoolError(f"--input-shapes: {source} has no input '{name}'", hint=f"its inputs: {known}")
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            tensor.shape.SetInParent()
            for _ in dims:
                tensor.shape.dim.add()
        model_dims = list(tensor.shape.dim)
        if len(model_dims) != len(dims):
            raise QtoolError(
                f"--input-shapes: input '{name}' of {source} has rank {len(model_dims)}, "
                f"not {len(dims)} ({'x'.join(map(str, dims))})"
            )
        for axis, (dim, size) in enumerate(zip(model_dims, dims, strict=True)):
            fixed = dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None
            if fixed is not None and fixed != size:
                raise QtoolError(
                    f"--input-shapes: input '{name}' of {source} has size {fixed} on axis {axis}, not {size}"
                )
            if fixed is None and not (axis == 0 and dim.dim_param):  # a symbolic batch stays symbolic
                dim.Clear()
                dim.dim_value = size


def restore_input_dims(model: onnx.ModelProto, original: Sequence[onnx.ValueInfoProto]) -> None:
    """Give ``model``'s inputs the shapes they had in ``original`` (the model as read), in place.

    The element type stays the model's: a quantized key/value cache input is int8 now.
    """
    types = {value.name: value.type for value in original}
    for value in model.graph.input:
        if value.name in types:
            rank = len(value.type.tensor_type.shape.dim)
            elem_type = value.type.tensor_type.elem_type
            value.type.CopyFrom(types[value.name])
            if value.type.HasField("tensor_type") and elem_type:
                value.type.tensor_type.elem_type = elem_type
            tensor = value.type.tensor_type
            if value.type.HasField("tensor_type") and not tensor.HasField("shape"):
                # no shape at all fails onnx's checker: the rank it was quantized at, every size left unknown
                tensor.shape.SetInParent()
                for _ in range(rank):
                    tensor.shape.dim.add()
