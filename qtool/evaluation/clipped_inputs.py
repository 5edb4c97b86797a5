"""Model inputs a candidate quantizes as it reads them, and the samples that reach past that 8-bit range.

A graph input read by a QuantizeLinear holds only the values its scale and zero point can write: a sample
past them (audio louder than any calibration clip, a brighter image) is clipped before the first layer, and
the error that follows is the data's, not the rounding's. Said in words, a low SQNR on such samples explains
itself: calibrate on samples that span what the model will read. Only a reach past the range by more than
:data:`PAST_SHARE` of its width is told: an observer that clips a long tail on purpose leaves values just past it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.calibration.dataset_types import Feed
from qtool.graph.index import all_nodes, all_subgraphs
from qtool.graph.weights import is_detached

# ops whose output holds every value of their first input (a constant Pad adds its constant, 0 by default)
KEEPS_VALUES = frozenset({"Pad", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Transpose", "Identity", "Expand"})
PAST_SHARE = 0.25  # a sample counts when it reaches past the range by more than this share of the range's width

_CODE_RANGES: dict[int, tuple[int, int]] = {
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT16: (-32768, 32767),
}


@dataclass(frozen=True)
class InputRange:
    """The float values a graph input's QuantizeLinear can write: ``low`` to ``high``, in steps of ``step``."""

    name: str
    low: float
    high: float
    step: float


@dataclass(frozen=True)
class ClippedInput:
    """An input whose samples reach past its range: how many of how many, and the farthest value."""

    range: InputRange
    samples: int
    of: int
    farthest: float

    def sentence(self, model: str, data: str) -> str:
        """The warning, naming the model, the input and the data."""
        r = self.range
        return (
            f"{model}: input '{r.name}' is quantized to [{r.low:.4g}, {r.high:.4g}] as it is read, and {self.samples} "
            f"of {self.of} samples of {data} reach past it (to {self.farthest:.4g}): those values clip before the "
            "first layer; calibrate on samples that span what the model will read"
        )


def quantized_input_ranges(model: onnx.ModelProto) -> list[InputRange]:
    """The range of each graph input a per-tensor QuantizeLinear reads (the narrowest, when several).

    The QuantizeLinear may read the input through ops that keep every value (:data:`KEEPS_VALUES`: a reflect
    Pad, an Unsqueeze, ...), in the main graph or an If/Loop body.
    """
    graphs = [model.graph, *all_subgraphs(model.graph)]
    constants = {i.name: i for g in graphs for i in g.initializer}
    constants.update(
        (n.output[0], n.attribute[0].t)
        for n in all_nodes(model.graph)
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"
    )
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in all_nodes(model.graph):
        for name in node.input:
            readers.setdefault(name, []).append(node)
    ranges: dict[str, InputRange] = {}
    for graph_input in (i.name for i in model.graph.input if i.name not in constants):
        for node in _quantizers(graph_input, readers):
            found = _range(node, constants, graph_input)
            if found is not None and (graph_input not in ranges or _width(found) < _width(ranges[graph_input])):
                ranges[graph_input] = found
    return list(ranges.values())


def _quantizers(name: str, readers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """The QuantizeLinear nodes that read ``name`` itself or through ops that keep every value of it."""
    found, seen, frontier = [], {name}, [name]
    while frontier:
        tensor = frontier.pop()
        for node in readers.get(tensor, []):
            if node.op_type == "QuantizeLinear" and node.domain in ("", "ai.onnx") and node.input[0] == tensor:
                found.append(node)
            elif node.op_type in KEEPS_VALUES and node.domain in ("", "ai.onnx") and node.input[0] == tensor:
                fresh = [out for out in node.output[:1] if out and out not in seen]
                seen.update(fresh)
                frontier.extend(fresh)
    return found


def clipped_inputs(ranges: list[InputRange], feeds: Iterable[Feed]) -> list[ClippedInput]:
    """The inputs of ``ranges`` that some of ``feeds`` reach past by more than :data:`PAST_SHARE` of their width."""
    if not ranges:
        return []
    past = {r.name: 0 for r in ranges}
    farthest = {r.name: 0.0 for r in ranges}
    count = 0
    for feed in feeds:
        count += 1
        for r in ranges:
            values = np.asarray(feed.get(r.name, np.zeros(0)), np.float64)
            if values.size == 0:
                continue
            low, high = float(values.min()), float(values.max())
            margin = max(r.step / 2, PAST_SHARE * (r.high - r.low))
            if low < r.low - margin or high > r.high + margin:
                past[r.name] += 1
                beyond = high if high - r.high >= r.low - low else low
                farthest[r.name] = beyond if abs(beyond) > abs(farthest[r.name]) else farthest[r.name]
    return [ClippedInput(r, past[r.name], count, farthest[r.name]) for r in ranges if past[r.name]]


def _range(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], name: str) -> InputRange | None:
    """The range a QuantizeLinear writes, when its scale is one constant value (None otherwise)."""
    scale_name = node.input[1] if len(node.input) > 1 else ""
    zero_name = node.input[2] if len(node.input) > 2 else ""
    if scale_name not in constants or is_detached(constants[scale_name]):
        return None
    scale = numpy_helper.to_array(constants[scale_name])
    if scale.size != 1:
        return None
    if zero_name:
        if zero_name not in constants or is_detached(constants[zero_name]):
            return None
        zero_tensor = constants[zero_name]
        if zero_tensor.data_type not in _CODE_RANGES or numpy_helper.to_array(zero_tensor).size != 1:
            return None
        qmin, qmax = _CODE_RANGES[zero_tensor.data_type]
        zero = float(numpy_helper.to_array(zero_tensor).reshape(-1)[0])
    else:
        (qmin, qmax), zero = _CODE_RANGES[onnx.TensorProto.UINT8], 0.0  # the default output type
    step = float(scale.reshape(-1)[0])
    return InputRange(name, (qmin - zero) * step, (qmax - zero) * step, step)


def _width(r: InputRange) -> float:
    return r.high - r.low
