"""Outputs that concatenate parts of different scales, scored part by part as well as whole.

A detector exported with one output often concatenates its boxes (pixels, in the hundreds) and its class
scores (0 to 1) along one axis (YOLOv8: ``[N, 4 + classes, anchors]``). One SQNR pooled over such an
output is the boxes' alone: a model whose scores are wrong scores as well as one whose scores are right
(a YOLOv8 detector's pooled 34.2 dB hid 12.3 dB on its class scores). So where the Concat that computes
an output (looked through one Transpose) joins parts whose mean energy per element differs by
:data:`SCALE_GAP` or more, each part is also measured on its own, named as a numpy slice of the output
(``output0[:, 4:22]``), and judged with the output it belongs to. Parts of one scale are left pooled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.graph.index import GraphView

SCALE_GAP = 10.0  # mean energy per element, largest part over smallest: 10 dB


@dataclass(frozen=True)
class ConcatLayout:
    """How an output's Concat joins its parts: the axis (the Concat's own, maybe negative) and each part's size."""

    axis: int
    sizes: tuple[int | None, ...]  # along the axis, None where the graph does not say
    perm: tuple[int, ...] | None = None  # the Transpose between the Concat and the output


@dataclass(frozen=True)
class OutputPart:
    """One part of an output, measured on its own as well."""

    output: str
    name: str  # ``output[:, 4:22]``
    index: tuple[slice, ...]

    def of(self, value: np.ndarray) -> np.ndarray:
        """The part of one value of the output."""
        return value[self.index]


def parts_note(names: Sequence[str]) -> str:
    """The output parts measured on their own (their names), in words ("": none)."""
    if not names:
        return ""
    listed = ", ".join(f"'{name}'" for name in names)
    return f"part by part too: {listed} (a Concat joins parts of different scales; the worst counts)"


def concat_layouts(model: onnx.ModelProto) -> dict[str, list[ConcatLayout]]:
    """The ways the Concats that compute each output of ``model`` split it, the outermost first.

    The outermost: a Concat of two or more computed inputs making the output (directly or through a Transpose;
    a key/value cache, which joins the past from a graph input to the new, is not one).
    Inside it, where every input is a Reshape of a Concat along one same axis of parts of the same sizes
    (a detector's boxes and scores joined per scale, then the scales joined), and each Reshape keeps the
    dimensions up to that axis, the output splits along that axis too.
    """
    view = GraphView(model)
    inputs = view.graph_inputs
    found: dict[str, tuple[onnx.NodeProto, tuple[int, ...] | None]] = {}
    for output in model.graph.output:
        node, perm = view.producer(output.name), None
        if node is not None and node.op_type == "Transpose":
            listed = _attribute(node, "perm")
            perm = tuple(listed) if isinstance(listed, list) else None
            node = view.producer(node.input[0])
        joined = [i for i in node.input if i] if node is not None and node.op_type == "Concat" else []
        if node is not None and len(joined) >= 2 and not inputs.intersection(joined):  # a cache joins a graph input
            found[output.name] = (node, perm)
    if not found:
        return {}
    shapes = _known_shapes(model)
    layouts: dict[str, list[ConcatLayout]] = {}
    for name, (node, perm) in found.items():
        axis = _axis(node)
        layouts[name] = [ConcatLayout(axis, tuple(_size(shapes.get(i), axis) for i in node.input if i), perm)]
        inner = _inner_layout(view, shapes, [i for i in node.input if i])
        if inner is not None and inner[0] != _normalized(axis, _rank(shapes.get(node.output[0]))):
            layouts[name].append(ConcatLayout(inner[0], inner[1], perm))
    return layouts


def scaled_parts(layouts: Mapping[str, list[ConcatLayout]], values: Mapping[str, np.ndarray]) -> list[OutputPart]:
    """The parts to measure on their own, decided on one sample's float outputs (``values``, by output name).

    Of an output's layouts, the first whose parts differ in scale by :data:`SCALE_GAP` or more.
    """
    parts: list[OutputPart] = []
    for name, candidates in layouts.items():
        value = values.get(name)
        if value is None or value.ndim == 0:
            continue
        for layout in candidates:
            cuts = _cuts(layout, value)
            if cuts is None:
                continue
            axis, bounds = cuts
            listed = [_part(name, axis, start, stop) for start, stop in bounds]
            energies = [float(np.mean(np.square(p.of(value), dtype=np.float64))) for p in listed]
            if min(energies) > 0 and max(energies) >= SCALE_GAP * min(energies):
                parts.extend(listed)
                break
    return parts


def _inner_layout(
    view: GraphView, shapes: Mapping[str, onnx.TensorShapeProto | list[int]], inputs: list[str]
) -> tuple[int, tuple[int | None, ...]] | None:
    """The axis (of the Reshapes' outputs) and the part sizes every input's inner Concat shares, or None.

    Each input is a Reshape of a Concat whose axis the Reshape leaves in place: it keeps every dimension up
    to it (YOLOv8-style, ``[N, 4 + classes, H, W] -> [N, 4 + classes, H * W]``), or it is the last axis
    and stays last at its size (YOLOv5-style, ``[N, 3, H, W, 5 + classes] -> [N, 3 * H * W, 5 + classes]``).
    """
    found = set()
    for tensor in inputs:
        reshape = view.producer(tensor)
        concat = view.producer(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
        if reshape is None or concat is None or concat.op_type != "Concat":
            return None
        joined, reshaped = _dims(shapes.get(concat.output[0])), _dims(shapes.get(reshape.output[0]))
        if joined is None or reshaped is None:
            return None
        axis = _normalized(_axis(concat), len(joined))
        if axis is None or not 0 <= axis < len(joined):
            return None
        sizes = tuple(_size(shapes.get(i), axis) for i in concat.input if i)
        if None not in joined[: axis + 1] and joined[: axis + 1] == reshaped[: axis + 1]:
            found.add((axis, sizes))
        elif axis == len(joined) - 1 and joined[-1] is not None and reshaped[-1] == joined[-1]:
            found.add((len(reshaped) - 1, sizes))
        else:
            return None  # the Reshape moves the parts' axis (or the graph does not say that it does not)
    if len(found) != 1:
        return None
    axis, sizes = found.pop()
    return (axis, sizes) if len(sizes) >= 2 and None not in sizes else None


def _cuts(layout: ConcatLayout, value: np.ndarray) -> tuple[int, list[tuple[int, int]]] | None:
    """The output axis the parts lie along and each part's [start, stop), or None where the graph does not fix them."""
    rank = value.ndim
    axis = layout.axis + rank if layout.axis < 0 else layout.axis
    if layout.perm is not None:
        if sorted(layout.perm) != list(range(rank)) or axis >= rank:
            return None
        axis = layout.perm.index(axis)
    if not 0 <= axis < rank:
        return None
    # only sizes the graph fixes: parts along an axis that varies with the input would move from sample to sample
    sizes = [s for s in layout.sizes if s is not None]
    if len(sizes) != len(layout.sizes) or sum(sizes) != value.shape[axis] or min(sizes) <= 0:
        return None
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return axis, bounds


def _part(output: str, axis: int, start: int, stop: int) -> OutputPart:
    index = (*([slice(None)] * axis), slice(start, stop))
    return OutputPart(output, f"{output}[{', '.join([':'] * axis + [f'{start}:{stop}'])}]", index)


def _known_shapes(model: onnx.ModelProto) -> dict[str, onnx.TensorShapeProto | list[int]]:
    """The shapes the graph states or onnx's shape inference finds, by tensor name (empty where it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - a graph onnx cannot infer keeps its parts unknown: the output is pooled
        inferred = model
    shapes: dict[str, onnx.TensorShapeProto | list[int]] = {}
    graph = inferred.graph
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            shapes[value.name] = value.type.tensor_type.shape
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _size(shape: onnx.TensorShapeProto | list[int] | None, axis: int) -> int | None:
    """The size of ``shape`` along ``axis`` (negative counts from the end), or None where it is unknown."""
    dims = _dims(shape)
    if dims is None or not -len(dims) <= axis < len(dims):
        return None
    return dims[axis]


def _dims(shape: onnx.TensorShapeProto | list[int] | None) -> list[int | None] | None:
    """Every dimension of ``shape`` (None where it is unknown), or None without a shape."""
    if shape is None:
        return None
    if isinstance(shape, list):
        return list(shape)
    return [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]


def _rank(shape: onnx.TensorShapeProto | list[int] | None) -> int | None:
    dims = _dims(shape)
    return None if dims is None else len(dims)


def _normalized(axis: int, rank: int | None) -> int | None:
    """``axis`` counted from the front (None where a negative axis meets an unknown rank)."""
    if axis >= 0:
        return axis
    return None if rank is None else axis + rank


def _axis(node: onnx.NodeProto) -> int:
    axis = _attribute(node, "axis")
    return axis if isinstance(axis, int) else 0


def _attribute(node: onnx.NodeProto, name: str) -> object:
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)
