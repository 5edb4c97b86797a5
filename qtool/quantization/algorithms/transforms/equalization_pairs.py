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
from onnx import TensorProto, helper

from qtool.graph.index import GraphView

LAYER_OPS = frozenset({"Conv", "Gemm", "MatMul"})
MAX_PATH = 3  # ops between two layers that are looked through
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE}
_HOMOGENEOUS = {"Relu", "LeakyRelu", "PRelu", "Identity"}  # f(s x) = s f(x) for s > 0, elementwise


@dataclass(frozen=True)
class ScaledLayer:
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
class PairCandidate:
    """A first layer, the layer its output reaches, the ops between, and the reason to skip ("" for none)."""

    first: int
    second: int
    ops: tuple[str, ...]
    reason: str


def constant_problem(graph: GraphView, name: str) -> str:
    """Why ``name`` may not be rescaled ("" when it may): not a float constant that only its layer reads."""
    if name not in graph.initializers:
        return f"'{name}' is not a constant initializer"
    if graph.initializers[name].data_type not in _FLOAT_TYPES:
        return f"'{name}' is not float"
    others = len(graph.readers.get(name, [])) - 1
    if others > 0 or name in graph.graph_outputs:
        return f"'{name}' is shared with {others} other reader(s)" if others > 0 else f"'{name}' is a graph output"
    return ""


def _attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def layer(index: int, graph: GraphView) -> ScaledLayer | str:
    """The :class:`ScaledLayer` node ``index`` is, or why it cannot be rescaled."""
    node = graph.nodes[index]
    name, output = graph.label(index), node.output[0]
    if node.op_type == "Conv":
        pads = _attribute(node, "pads", [])
        auto_pad = _attribute(node, "auto_pad", b"NOTSET")
        padded = any(int(p) for p in pads) or auto_pad not in (b"NOTSET", b"VALID")
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        group = int(_attribute(node, "group", 1))
        found = ScaledLayer(index, name, "conv", node.input[1], False, group, bias, index, 2, output, padded)
        return _checked(graph, found)
    if node.op_type == "Gemm":
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        transposed = not int(_attribute(node, "transB", 0))
        problem = "Gemm reads its input transposed (transA=1)" if int(_attribute(node, "transA", 0)) else ""
        found = ScaledLayer(index, name, "linear", node.input[1], transposed, 1, bias, index, 2, output, False, problem)
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
            graph, ScaledLayer(index, name, "linear", node.input[1], True, 1, bias, bias_node, bias_slot, output, False)
        )
    return f"{name}: {node.op_type} is not a Conv, Gemm or MatMul"


def _checked(graph: GraphView, found: ScaledLayer) -> ScaledLayer | str:
    for constant in (found.weight, found.bias):
        problem = constant_problem(graph, constant) if constant else ""
        if problem:
            return f"{found.name}: {problem}"
    return found


def _step_problem(node: onnx.NodeProto, family: str, graph: GraphView, clip_pairs: bool) -> str:
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


def _clip_bounds(node: onnx.NodeProto, graph: GraphView) -> tuple[float | None, float | None] | None:
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


def candidates(graph: GraphView, clip_pairs: bool) -> list[PairCandidate]:
    """Every layer that reaches another layer through single-reader ops, in node order."""
    found = []
    for index, node in enumerate(graph.nodes):
        if node.op_type not in LAYER_OPS:
            continue
        first = layer(index, graph)
        family = first.family if isinstance(first, ScaledLayer) else ("conv" if node.op_type == "Conv" else "linear")
        start = first.output if isinstance(first, ScaledLayer) else node.output[0]
        walked = _walk(start, family, graph, clip_pairs)
        if walked is not None:
            found.append(PairCandidate(index, *walked))
    return found


def _walk(tensor: str, family: str, graph: GraphView, clip_pairs: bool) -> tuple[int, tuple[str, ...], str] | None:
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
