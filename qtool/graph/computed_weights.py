"""Weights an exporter computes from constants at run time, computed once so that they can be quantized.

PyTorch's ``weight_norm`` exports a convolution's weight as ``g * v / ||v||`` (ReduceL2, Div, Mul of two
initializers); a traced LSTM gets its W and R from Slice/Concat/Unsqueeze of its constant gate blocks; a
model exported without constant folding reads a weight through Cast or Mul by a constant. onnxruntime folds
such nodes when the session starts, but until then the op's weight is a node output, not a constant: qtool
would leave the node float. :func:`fold_computed_weights` runs them once, on onnxruntime itself (so the
values are the ones the model would compute), and puts their results in as initializers.

Only what reaches a weight input is folded (a Conv/ConvTranspose/Gemm/MatMul/LSTM/GRU/RNN input that holds
weights or a bias; not a Gather's, whose input 0 is as often a shape as a table), through pure elementwise,
reduction and layout ops (:data:`FOLDABLE`): no op that makes values from nothing or from a shape
(ConstantOfShape, Range, Expand, Tile: a small file whose weight grows at load keeps that form; the Shape of
an Expand of constants is read off first, as torch sizes an LSTM's gate slices by its initial state), no random
op, no MatMul of two constants (a factorised weight would lose its factorisation), no node whose output a
graph returns, and nothing whose results would take more bytes than the constants they replace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.index import GraphView, node_subgraphs, subgraph_reads
from qtool.graph.weights import DETACH_MIN_BYTES, Weights, mark_detached

FOLDABLE = frozenset(
    {
        "Identity", "Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
        "Gather", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Pow", "Exp", "Log", "Reciprocal", "Clip",
        "Max", "Min", "Sign", "Tanh", "Sigmoid", "ReduceL2", "ReduceL1", "ReduceSum", "ReduceSumSquare",
        "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "Shape", "Size",
    }
)  # fmt: skip
# op -> the inputs that hold its weights (and bias): what folding is for
WEIGHT_INPUTS = {
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "Gemm": (1, 2),
    "MatMul": (0, 1),
    "LSTM": (1, 2, 3),
    "GRU": (1, 2, 3),
    "RNN": (1, 2, 3),
}


def fold_computed_weights(model: onnx.ModelProto, weights: Weights) -> list[str]:
    """Fold the graph's nodes that compute weights from constants; returns the nodes folded.

    Bodies keep theirs: their constants live in the graph (prepare moves them there), where sibling bodies may
    read the same ones (Silero VAD's two LSTMs build their weights from one set of gate blocks), so a body's
    folded copy would add bytes that the graph's constants still hold.
    """
    graph = model.graph
    constants = {init.name: init for init in graph.initializer}
    _shapes_of_constant_expands(model, constants, weights)
    try:
        chosen = _weight_computations(graph, constants)
    except RecursionError:  # a chain of thousands of nodes computing one weight: it stays computed
        return []
    if not chosen:
        return []
    values = _run(
        chosen, _needed_outputs(graph, chosen), constants, weights, (list(model.opset_import), model.ir_version)
    )
    if values is None or _grows(values, chosen, constants, _read_elsewhere(graph, chosen)):
        return []
    for name, array in values.items():
        graph.initializer.append(_initializer(name, array, weights))
    folded = {id(node) for node in chosen}
    keep = [node for node in graph.node if id(node) not in folded]
    del graph.node[:]
    graph.node.extend(keep)
    return [node.name for node in chosen]


def _shapes_of_constant_expands(model: onnx.ModelProto, constants: dict[str, TensorProto], weights: Weights) -> None:
    """Each Shape of an Expand of values computed from constants becomes a constant.

    torch's exporter (without its optimizer) sizes an LSTM's gate slices by the shape of its zero initial state,
    an Expand: Expand makes values from a shape and is never folded, so the weights it sizes stayed computed.
    Only the shape is kept (the Expand stays for whatever else reads it).
    """
    graph = model.graph
    view = GraphView(graph)  # the graph before this loop's folds
    for shape in list(graph.node):
        expand = view.producer(shape.input[0]) if shape.op_type == "Shape" and shape.input else None
        if expand is None or expand.op_type != "Expand" or shape.output[0] in view.graph_outputs:
            continue
        chain = _constant_chain(list(expand.input), view, constants)
        if chain is None:
            continue
        versions = (list(model.opset_import), model.ir_version)
        value = _run([*chain, expand, shape], [shape.output[0]], constants, weights, versions)
        if value is None:
            continue
        tensor = numpy_helper.from_array(value[shape.output[0]], shape.output[0])
        graph.initializer.append(tensor)
        constants[tensor.name] = tensor
        graph.node.remove(shape)


def _pure(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is an op of :data:`FOLDABLE` (ONNX's own, no body): constants in, the same values out."""
    return node.op_type in FOLDABLE and node.domain in ("", "ai.onnx") and not node_subgraphs(node)


def _constant_chain(
    names: list[str], view: GraphView, constants: Mapping[str, TensorProto]
) -> list[onnx.NodeProto] | None:
    """The foldable nodes that compute ``names`` from constants alone, in dependency order (None: not all can)."""
    chain: list[onnx.NodeProto] = []
    for name in names:
        if not name or name in constants:
            continue
        node = view.producer(name)
        if node is None or not _pure(node):
            return None
        inner = _constant_chain(list(node.input), view, constants)
        if inner is None:
            return None
        chain += [n for n in [*inner, node] if all(n is not c for c in chain)]
    return chain


def _weight_computations(graph: onnx.GraphProto, constants: Mapping[str, TensorProto]) -> list[onnx.NodeProto]:
    """The foldable nodes whose results reach a weight input (through other foldable nodes), in graph order."""
    view = GraphView(graph)
    returned = view.graph_outputs
    computable: dict[int, bool] = {}

    def can_fold(node: onnx.NodeProto) -> bool:
        key = id(node)
        if key not in computable:
            computable[key] = False  # a cycle (never in a valid graph) folds nothing
            computable[key] = (
                _pure(node)
                and not any(out in returned for out in node.output)
                and all(
                    name in constants or ((writer := view.producer(name)) is not None and can_fold(writer))
                    for name in node.input
                    if name
                )
            )
        return computable[key]

    reached: dict[int, onnx.NodeProto] = {}
    stack = [
        writer
        for node in view.nodes
        for index in WEIGHT_INPUTS.get(node.op_type, ())
        if node.domain in ("", "ai.onnx")
        for name in node.input[index : index + 1]
        if name not in constants and (writer := view.producer(name)) is not None
    ]
    while stack:
        node = stack.pop()
        if id(node) in reached or not can_fold(node):
            continue
        reached[id(node)] = node
        stack += [writer for name in node.input if (writer := view.producer(name)) is not None]
    return [node for node in view.nodes if id(node) in reached]


def _needed_outputs(graph: onnx.GraphProto, chosen: list[onnx.NodeProto]) -> list[str]:
    """The outputs of ``chosen`` that a node left in the graph (or a body) reads."""
    read = _read_elsewhere(graph, chosen)
    return [out for node in chosen for out in node.output if out and out in read]


def _read_elsewhere(graph: onnx.GraphProto, chosen: list[onnx.NodeProto]) -> set[str]:
    """What the nodes not in ``chosen`` (and their bodies) read, and what the graph returns."""
    inside = {id(node) for node in chosen}
    read = {o.name for o in graph.output}
    for node in graph.node:
        if id(node) not in inside:
            read.update(node.input)
            read.update(subgraph_reads(node))
    return read


def _run(
    chosen: list[onnx.NodeProto],
    needed: list[str],
    constants: Mapping[str, TensorProto],
    weights: Weights,
    versions: tuple[list[onnx.OperatorSetIdProto], int],
) -> dict[str, np.ndarray] | None:
    """The values of ``needed``, computed by onnxruntime from the constants; None when it cannot."""
    if not needed:
        return None
    read = {name for node in chosen for name in node.input if name in constants}
    inits = [numpy_helper.from_array(weights.value(constants[name]), name) for name in sorted(read)]
    outputs = [helper.make_empty_tensor_value_info(name) for name in needed]
    graph = helper.make_graph(chosen, "computed_weights", [], outputs, inits)
    opsets, ir_version = versions
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results = session.run(needed, {})
    except Exception:  # noqa: BLE001 - what onnxruntime cannot compute stays as it is (it fails the same at load)
        return None
    return {name: np.asarray(value) for name, value in zip(needed, results, strict=True)}


def _grows(
    values: Mapping[str, np.ndarray],
    chosen: list[onnx.NodeProto],
    constants: Mapping[str, TensorProto],
    kept: set[str],
) -> bool:
    """Whether the folded values take more bytes than the constants they come from (then they stay computed).

    A weight read twice (two Slices of one table concatenated twice, say), or a constant that ``kept`` (what
    the nodes left read) still needs, would be stored twice.
    """
    read = {name for node in chosen for name in node.input if name in constants and name not in kept}
    source = sum(math.prod(constants[name].dims) * _itemsize(constants[name]) for name in read)
    return sum(array.nbytes for array in values.values()) > source


def _itemsize(tensor: TensorProto) -> int:
    return int(np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize)


def _initializer(name: str, values: np.ndarray, weights: Weights) -> TensorProto:
    tensor = numpy_helper.from_array(values, name)
    if values.nbytes >= DETACH_MIN_BYTES and values.dtype == np.float32:
        weights.arrays[name] = values
        mark_detached(tensor)
    return tensor
