"""Finding the layer pairs that cross-layer equalization may rescale, and why others are left alone.

A pair is two layers (Conv, Gemm, or MatMul with a constant weight) joined through ops that commute
with a positive per-channel scale: ``f(s x) = s f(x)`` for ``s > 0`` holds for Relu, LeakyRelu and PRelu
(any slope), MaxPool, and a Clip with min 0 and no max. A Clip with a max (Relu6) does not commute:
the scaled model clips at ``s * max``. Every tensor between the two layers must have exactly one reader
and not be a graph output, and every weight and bias rescaled must be an initializer that only its layer
reads, so that rescaling it cannot change any other computation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.prepare import subgraph_reads

LAYER_OPS = frozenset({"Conv", "Gemm", "MatMul"})
MAX_PATH = 3  # ops between two layers that are looked through
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE}
_HOMOGENEOUS = {"Relu", "LeakyRelu", "PRelu", "Identity"}  # f(s x) = s f(x) for s > 0, elementwise


@dataclass(frozen=True)
class Layer:
    """One Conv, Gemm or MatMul whose weight (and bias) may be rescaled per channel.

    The weight is handled in a canonical layout ``[out, in / group, *kernel]``: a Conv's own, a Gemm
    weight with transB=1 as stored, and a ``[K, N]`` weight (MatMul, Gemm with transB=0) transposed.
    A bias has its channels on its last axis; a MatMul's bias is the constant of the Add reading it.
    """

    index: int  # position in graph.node
    name: str
    family: str  # "conv": channels on axis 1; "linear": channels on the last axis
    weight: str
    transposed: bool  # weight stored [K, N]
    group: int
    bias: str | None
    bias_node: int  # the node reading the bias (the layer, or a MatMul's Add); -1: no bias can be added
    bias_slot: int
    output: str  # after a MatMul's bias Add
    padded: bool  # pads with zeros: a bias absorbed into it would be wrong at the borders
    second_problem: str = ""  # why it cannot be the second layer of a pair
    alpha: float = 1.0  # Gemm: Y = alpha * A B + beta * C
    beta: float = 1.0


@dataclass(frozen=True)
class Candidate:
    """A first layer, the layer its output reaches, the ops between, and the reason to skip ("" for none)."""

    first: int
    second: int
    ops: tuple[str, ...]
    reason: str


class GraphIndex:
    """Who reads what in a model's top-level graph, and its constants."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.initializers = {tensor.name: tensor for tensor in graph.initializer}
        self.graph_inputs = {value.name for value in graph.input}
        self.graph_outputs = {value.name for value in graph.output}
        self.readers: dict[str, list[tuple[int, int]]] = {}  # tensor -> (node index, input slot); slot -1: a body
        for index, node in enumerate(self.nodes):
            for slot, name in enumerate(node.input):
                if name:
                    self.readers.setdefault(name, []).append((index, slot))
            for name in sorted(subgraph_reads(node)):
                self.readers.setdefault(name, []).append((index, -1))

    def label(self, index: int) -> str:
        node = self.nodes[index]
        return node.name or node.output[0]

    def constant_problem(self, name: str) -> str:
        """Why ``name`` may not be rescaled ("" when it may): not an own float initializer."""
        if name not in self.initializers or name in self.graph_inputs:
            return f"'{name}' is not a constant initializer"
        if self.initializers[name].data_type not in _FLOAT_TYPES:
            return f"'{name}' is not float"
        others = len(self.readers.get(name, [])) - 1
        if others > 0 or name in self.graph_outputs:
            return f"'{name}' is shared with {others} other reader(s)" if others > 0 else f"'{name}' is a graph output"
        return ""

    def scalar(self, name: str) -> float | None:
        """The value of a one-element initializer, else None."""
        tensor = self.initializers.get(name)
        if tensor is None or name in self.graph_inputs:
            return None
        values = numpy_helper.to_array(tensor) if tensor.data_location != TensorProto.EXTERNAL else None
        return float(values.reshape(-1)[0]) if values is not None and values.size == 1 else None

    def sole_reader(self, tensor: str) -> tuple[int, int] | None:
        """The one (node, slot) reading ``tensor``, if exactly one does and it is no graph output."""
        readers = self.readers.get(tensor, [])
        return readers[0] if len(readers) == 1 and tensor not in self.graph_outputs else None


def _attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def layer(index: int, graph: GraphIndex) -> Layer | str:
    """The :class:`Layer` node ``index`` is, or why it cannot be rescaled."""
    node = graph.nodes[index]
    name, output = graph.label(index), node.output[0]
    if node.op_type == "Conv":
        pads = _attribute(node, "pads", [])
        auto_pad = _attribute(node, "auto_pad", b"NOTSET")
        padded = any(int(p) for p in pads) or auto_pad not in (b"NOTSET", b"VALID")
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        group = int(_attribute(node, "group", 1))
        return _checked(graph, Layer(index, name, "conv", node.input[1], False, group, bias, index, 2, output, padded))
    if node.op_type == "Gemm":
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        transposed = not int(_attribute(node, "transB", 0))
        problem = "Gemm reads its input transposed (transA=1)" if int(_attribute(node, "transA", 0)) else ""
        found = Layer(index, name, "linear", node.input[1], transposed, 1, bias, index, 2, output, False, problem)
        alpha, beta = float(_attribute(node, "alpha", 1.0)), float(_attribute(node, "beta", 1.0))
        return _checked(graph, replace(found, alpha=alpha, beta=beta))
    if node.op_type == "MatMul":
        weight = graph.initializers.get(node.input[1])
        if weight is None or len(weight.dims) != 2:
            return f"{name}: the MatMul weight '{node.input[1]}' is not a 2-D initializer"
        bias, bias_node, bias_slot = None, -1, -1
        reader = graph.sole_reader(output)
        if reader is not None and graph.nodes[reader[0]].op_type == "Add":
            add = graph.nodes[reader[0]]
            constant = add.input[1 - reader[1]]
            tensor = graph.initializers.get(constant)
            if tensor is not None and (not tensor.dims or tensor.dims[-1] in (1, weight.dims[1])):
                bias, bias_node, bias_slot, output = constant, reader[0], 1 - reader[1], add.output[0]
        return _checked(
            graph, Layer(index, name, "linear", node.input[1], True, 1, bias, bias_node, bias_slot, output, False)
        )
    return f"{name}: {node.op_type} is not a Conv, Gemm or MatMul"


def _checked(graph: GraphIndex, found: Layer) -> Layer | str:
    for constant in (found.weight, found.bias):
        problem = graph.constant_problem(constant) if constant else ""
        if problem:
            return f"{found.name}: {problem}"
    return found


def _step_problem(node: onnx.NodeProto, family: str, graph: GraphIndex, clip_pairs: bool) -> str:
    """Why a per-channel scale does not pass through ``node`` unchanged ("" when it does)."""
    if node.op_type in _HOMOGENEOUS:
        return ""
    if node.op_type == "MaxPool":
        if family != "conv":
            return "MaxPool after a Gemm/MatMul pools across channels"
        return "" if len(node.output) < 2 or not node.output[1] else "MaxPool's indices output is used"
    if node.op_type == "Clip":
        bounds = _clip_bounds(node, graph)
        if bounds is None:
            return "Clip bounds are not constant"
        low, high = bounds
        if low is None and high is None:
            return ""
        if low != 0.0:
            return f"Clip min is {low}, not 0"
        if high is not None and not clip_pairs:
            return f"Clip max {high} (Relu6-style) would move with the scale; allow it with clip_pairs"
        return ""
    return f"{node.op_type} does not commute with a per-channel scale"


def _clip_bounds(node: onnx.NodeProto, graph: GraphIndex) -> tuple[float | None, float | None] | None:
    """(min, max) of a Clip, each None when absent; None when a bound is not a constant."""
    bounds: list[float | None] = []
    for slot, attr in ((1, "min"), (2, "max")):
        if len(node.input) > slot and node.input[slot]:
            value = graph.scalar(node.input[slot])
            if value is None:
                return None
            bounds.append(value)
        else:
            found = _attribute(node, attr, None)
            bounds.append(None if found is None else float(found))
    return bounds[0], bounds[1]


def candidates(graph: GraphIndex, clip_pairs: bool) -> list[Candidate]:
    """Every layer that reaches another layer through single-reader ops, in node order."""
    found = []
    for index, node in enumerate(graph.nodes):
        if node.op_type not in LAYER_OPS:
            continue
        first = layer(index, graph)
        family = first.family if isinstance(first, Layer) else ("conv" if node.op_type == "Conv" else "linear")
        start = first.output if isinstance(first, Layer) else node.output[0]
        walked = _walk(start, family, graph, clip_pairs)
        if walked is not None:
            found.append(Candidate(index, *walked))
    return found


def _walk(tensor: str, family: str, graph: GraphIndex, clip_pairs: bool) -> tuple[int, tuple[str, ...], str] | None:
    """The layer ``tensor`` reaches through single-reader ops: (its index, the ops between, why not)."""
    ops: list[str] = []
    problem = ""
    for _ in range(MAX_PATH + 1):
        readers = graph.readers.get(tensor, [])
        layers = [index for index, slot in readers if graph.nodes[index].op_type in LAYER_OPS and slot == 0]
        if len(readers) != 1 or tensor in graph.graph_outputs:
            if not layers:
                return None
            where = "is a graph output" if tensor in graph.graph_outputs else f"has {len(readers)} readers"
            return layers[0], tuple(ops), problem or f"'{tensor}' {where}"
        index, slot = readers[0]
        node = graph.nodes[index]
        if node.op_type in LAYER_OPS:
            return (index, tuple(ops), problem) if slot == 0 else None
        if slot != 0 or len(ops) == MAX_PATH:
            return None
        ops.append(node.op_type)
        problem = problem or _step_problem(node, family, graph, clip_pairs)
        tensor = node.output[0]
    return None


def channels_problem(first: np.ndarray, second: np.ndarray, group: int) -> str:
    """Why two canonical weights do not share their channels ("" when they do)."""
    if first.shape[0] != group * second.shape[1] or second.shape[0] % group:
        return f"{first.shape[0]} output channels do not feed {group} x {second.shape[1]} input channels"
    if not (np.isfinite(first).all() and np.isfinite(second).all()):
        return "a weight holds NaN or infinity"
    return ""
