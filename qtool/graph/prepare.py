"""Graph preparation before quantization: our own replacement for onnxruntime's quant_pre_process.

Each step degrades gracefully: shape inference that fails is reported, not fatal. Float tensor names that
users see are kept, so statistics gathered on the prepared model line up with the original model's tensors.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from qtool.errors import QtoolError
from qtool.graph.computed_weights import fold_computed_weights
from qtool.graph.conv_affine import fold_conv_affine
from qtool.graph.float16 import has_float16, upcast_float16
from qtool.graph.foreign_ops import infer_through_contrib_ops, park_unknown_ops, unpark
from qtool.graph.functions import inline_local_functions
from qtool.graph.hard_activations import rewrite_hard_activations
from qtool.graph.index import all_nodes, all_subgraphs, node_subgraphs, subgraph_reads
from qtool.graph.loop_constants import read_constant_loop_state
from qtool.graph.names import fresh_name
from qtool.graph.node_order import sort_nodes
from qtool.graph.weight_layout import einsums_as_matmuls, fold_weight_layout_ops
from qtool.graph.weights import Weights

log = logging.getLogger(__name__)

PER_CHANNEL_MIN_OPSET = 13  # per-axis QuantizeLinear/DequantizeLinear
_CONSTANT_VALUE_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints")


@dataclass
class PrepareReport:
    """What :func:`prepare_model` changed."""

    constants_to_initializers: int = 0
    folded_batchnorms: list[str] = field(default_factory=list)
    folded_affine: list[str] = field(default_factory=list)  # constant Mul/Add/Sub/Div after a Conv, now in it
    folded_shapes: list[str] = field(default_factory=list)  # Shape nodes of initializers, now constants
    inlined_functions: list[str] = field(default_factory=list)  # model-local functions inlined (domain:name)
    folded_weight_layouts: list[str] = field(default_factory=list)  # Transpose/Reshape/... of weights, now constants
    folded_computed_weights: list[str] = field(default_factory=list)  # nodes computing weights from constants
    loops_reading_constant_state: list[str] = field(default_factory=list)  # Loops whose unchanged state is a constant
    sorted_nodes: bool = False  # the nodes were out of order (onnxruntime runs such a model; onnx refuses it)
    einsums_as_matmuls: list[str] = field(default_factory=list)  # Einsums with a constant weight, now MatMuls
    hard_activations: list[str] = field(default_factory=list)  # hard-sigmoid/swish (written out, or HardSwish ops)
    removed_initializers: int = 0
    initializers_removed_from_inputs: int = 0
    opset_before: int = 0
    opset_after: int = 0
    shape_inference_error: str | None = None
    float16_weights: list[str] | None = None  # a float16 model: computed in float32 inside, these weights widened


# Ops that only appear in models something has already quantized (ONNX and onnxruntime's contrib ops).
# MatMulNBits is not among them: a weight-only op with float inputs and outputs, which onnxruntime's
# model builder writes for a decoder's projections, it is passed through and the rest is quantized.
QUANTIZED_OPS = {
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
    "MatMulInteger", "QGemm", "QLinearAdd", "QLinearMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
}  # fmt: skip


def refuse_quantized(model: onnx.ModelProto, source: str) -> None:
    """Raise when ``model`` already holds quantization ops: quantizing twice compounds the error.

    Raises:
        QtoolError: naming the first such node, or qtool as the model's producer.
    """
    for node in all_nodes(model.graph):
        if node.op_type in QUANTIZED_OPS:
            raise QtoolError(
                f"{source} is already quantized (node '{node.name or node.output[0]}' is {node.op_type})",
                hint="give qtool the float model it came from",
            )
    if model.producer_name == "qtool":  # weight-only outputs hold Cast/Mul, not Q/DQ, but are quantized all the same
        raise QtoolError(
            f"{source} is already quantized (its producer is qtool)",
            hint="give qtool the float model it came from",
        )


def default_opset(model: onnx.ModelProto) -> int:
    """The model's opset for the default ("" / ai.onnx) domain."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def prepare_model(
    model: onnx.ModelProto,
    weights: Weights | None = None,
    *,
    min_opset: int = 0,
    target_opset: int | None = None,
    source: str = "the model",
) -> tuple[onnx.ModelProto, PrepareReport]:
    """Return a copy of ``model`` ready for calibration and Q/DQ insertion.

    Steps: Constant nodes become initializers; the opset is converted to
    ``target_opset`` (raised or lowered), or raised to ``min_opset`` when lower
    (see :mod:`qtool.graph.opsets`); layout ops of weights are folded and Einsums with a constant
    weight become MatMuls (see :mod:`qtool.graph.weight_layout`); weights computed from constants at run
    time are computed (see :mod:`qtool.graph.computed_weights`) and a Loop's unchanged constant state is read
    as the constant (see :mod:`qtool.graph.loop_constants`); hard-sigmoids and hard-swishes written out as
    Add/Clip/Div/Mul become HardSigmoid (and Mul, see :mod:`qtool.graph.hard_activations`); BatchNormalization
    and Mul/Add/Sub/Div by a per-channel constant are folded into the Conv before them (see
    :mod:`qtool.graph.conv_affine`); the Shape of an initializer becomes a constant, and initializers no
    node reads any more are dropped; ONNX shape inference annotates tensor types where it can. Detached values
    (see :mod:`qtool.graph.weights`) are read from ``weights``; folded ones replace them there.

    Raises:
        QtoolError: onnx's version converter cannot reach the opset; the message names ``source``.
    """
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    report = PrepareReport(opset_before=default_opset(prepared))
    prepared, report.inlined_functions = inline_local_functions(prepared)
    report.sorted_nodes = sort_nodes(prepared.graph)
    weights = weights if weights is not None else Weights()
    report.constants_to_initializers = _constants_to_initializers(prepared.graph)
    if report.constants_to_initializers and weights.detach(prepared.graph):
        slim = onnx.ModelProto()  # large Constant values now live in the store: drop their protobuf copies
        slim.CopyFrom(prepared)
        prepared = slim
    report.initializers_removed_from_inputs = _initializers_out_of_inputs(prepared)
    if has_float16(prepared.graph):
        report.float16_weights = upcast_float16(prepared.graph, weights)
    target = target_opset if target_opset is not None else max(report.opset_before, min_opset)
    if target != report.opset_before:
        prepared = _convert_opset(prepared, report.opset_before, target, source)
        report.constants_to_initializers += _constants_to_initializers(prepared.graph)  # (see _convert_opset)
        # The converter keeps the IR version, but opset 21 (INT4) needs IR 10 and opset 25 (INT2) IR 13.
        opset = helper.make_opsetid("", target)
        prepared.ir_version = max(prepared.ir_version, helper.find_min_ir_version_for([opset]))
    report.opset_after = default_opset(prepared)
    _name_unnamed_nodes(prepared.graph)  # after the upgrade: the version converter adds unnamed nodes
    fixed = {o.name for o in prepared.graph.output} | {i.name for i in prepared.graph.input}
    fixed |= _subgraph_inputs(prepared.graph)
    report.folded_weight_layouts = fold_weight_layout_ops(prepared.graph, weights, fixed)
    report.einsums_as_matmuls = einsums_as_matmuls(prepared.graph, weights, fixed)
    report.folded_shapes = _fold_shapes_of_initializers(prepared.graph)  # constants for the computed weights' chains
    report.folded_computed_weights = fold_computed_weights(prepared, weights)
    report.loops_reading_constant_state = read_constant_loop_state(prepared.graph)
    report.hard_activations = rewrite_hard_activations(prepared.graph)  # first: its "+ 3" after a Conv is affine
    report.folded_batchnorms, report.folded_affine = fold_conv_affine(prepared.graph, weights)
    report.removed_initializers = _remove_unused_initializers(prepared.graph)
    prepared, report.shape_inference_error = _infer_shapes(prepared)
    return prepared, report


def _constants_to_initializers(graph: onnx.GraphProto) -> int:
    """Turn Constant nodes (as Paddle and TensorFlow exporters emit) into initializers of the main graph.

    A body's Constant (an If branch or a Loop body exported with its weights inlined) moves up too: a
    constant reads nothing, so it means the same in the outer scope, where the bodies' pipeline finds the
    weights it may quantize (see :mod:`qtool.graph.branches`). One a body returns as its output stays, and so
    does one whose name another scope uses too (sibling branches may each define their own).
    """
    defined = Counter(n for node in all_nodes(graph) if node.op_type == "Constant" for n in node.output)
    shared = {name for name, count in defined.items() if count > 1}
    shared |= {i.name for i in graph.initializer} | {i.name for i in graph.input}
    moved = [_constant_tensor(node) for node in _hoisted_constants(graph, shared, top=True)]
    graph.initializer.extend(moved)
    return len(moved)


def _hoisted_constants(graph: onnx.GraphProto, shared: set[str], *, top: bool) -> list[onnx.NodeProto]:
    """Remove the Constant nodes that can become main-graph initializers from ``graph`` and its bodies; return them.

    ``shared``: names defined more than once in the model (a body's Constant of such a name stays in its body).
    """
    outputs = set() if top else {o.name for o in graph.output} | shared
    kept, moved = [], []
    for node in graph.node:
        attr = node.attribute[0] if node.op_type == "Constant" and len(node.attribute) == 1 else None
        movable = attr is not None and attr.name in _CONSTANT_VALUE_ATTRS and node.domain in ("", "ai.onnx")
        if movable and node.output[0] not in outputs:
            moved.append(node)
            continue
        kept.append(node)
        for body in node_subgraphs(node):
            moved.extend(_hoisted_constants(body, shared, top=False))
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)
    return moved


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto:
    """The value of a Constant node as a tensor named after its output."""
    attr = node.attribute[0]
    value = helper.get_attribute_value(attr)
    if attr.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(value)
    else:
        dtype = np.float32 if attr.name.startswith("value_float") else np.int64
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype))
    tensor.name = node.output[0]
    return tensor


def _initializers_out_of_inputs(model: onnx.ModelProto) -> int:
    """Stop listing initializers as graph inputs, so they are treated as the constants they are.

    IR < 4 models and PyTorch exports with ``keep_initializers_as_inputs=True`` list
    every weight as an overridable input; nothing can be quantized or folded then.
    """
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    kept = [value for value in graph.input if value.name not in initializers]
    removed = len(graph.input) - len(kept)
    if removed:
        del graph.input[:]
        graph.input.extend(kept)
    if graph.initializer:  # IR 4 is the first where initializers need not be inputs (Constant nodes became some)
        model.ir_version = max(model.ir_version, 4)
    return removed


def _name_unnamed_nodes(graph: onnx.GraphProto, taken: set[str] | None = None) -> None:
    """Give every node a unique name, bodies' too, so configs, plans and reports can refer to it."""
    taken = set() if taken is None else taken
    for index, node in enumerate(graph.node):
        node.name = fresh_name(node.name or f"{node.op_type}_{index}", taken)
        for body in node_subgraphs(node):
            _name_unnamed_nodes(body, taken)


def _convert_opset(model: onnx.ModelProto, current: int, target: int, source: str) -> onnx.ModelProto:
    """``model`` at opset ``target``; attributes that became inputs (Clip's bounds, Pad's pads) are Constant nodes."""
    if not any(entry.domain in ("", "ai.onnx") for entry in model.opset_import):  # ai.onnx.ml alone: no node to
        model.opset_import.append(helper.make_opsetid("", target))  # convert, the Q/DQ opset is imported
        return model
    parked = park_unknown_ops(model)
    try:
        converted = version_converter.convert_version(model, target)
        if parked:
            unpark(converted)
    except Exception as e:  # the converter raises bare RuntimeError/ValidationError subclasses
        reason = _converter_reason(e)
        if target < current:
            raise QtoolError(
                f"{source} uses opset {current}; quantizing it needs opset {target}, and onnx's version converter "
                f"cannot lower it: {reason}",
                hint=f"export the model at opset {target} or lower, or install an onnxruntime whose "
                f"QuantizeLinear/DequantizeLinear kernels reach opset {current}",
            ) from e
        raise QtoolError(
            f"cannot upgrade {source} from opset {current} to {target}, which Q/DQ quantization needs: {reason}",
            hint="export the model with a newer opset"
            + (", or use 'granularity: per_tensor' for weights" if target == PER_CHANNEL_MIN_OPSET else ""),
        ) from e
    finally:
        if parked:
            unpark(model)
    log.info("converted %s from opset %d to %d", source, current, target)
    return converted


def _converter_reason(error: Exception) -> str:
    """The converter's own words, without the C++ file and assertion it raised them from."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line.split("failed: ", 1)[-1]


def _fold_shapes_of_initializers(graph: onnx.GraphProto) -> list[str]:
    """Replace ``Shape(initializer)`` by an int64 initializer holding that shape; returns the nodes folded.

    tf2onnx exports read weight shapes at run time; once folded, a weight that only a Shape read
    is no longer used and is dropped instead of being kept (and stored) in float.
    """
    inits = {init.name: init for init in graph.initializer}
    outputs = {o.name for o in graph.output}
    folded: list[str] = []
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        source = inits.get(node.input[0]) if node.op_type == "Shape" and len(node.input) == 1 else None
        if source is None or node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
            kept.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(source.dims))
        if not (isinstance(start, int) and isinstance(end, int)):
            kept.append(node)  # a malformed attribute: leave the node for onnxruntime to judge
            continue
        # opset 15's start/end: negative counts from the end, then both clamp to [0, rank] - Python's slicing
        dims = list(source.dims)[start:end]
        graph.initializer.append(numpy_helper.from_array(np.asarray(dims, dtype=np.int64), node.output[0]))
        folded.append(node.name)
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
    return folded


def _remove_unused_initializers(graph: onnx.GraphProto) -> int:
    """Drop initializers no node reads (BatchNormalization parameters after folding, dead weights)."""
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    used |= _subgraph_inputs(graph)
    kept = [init for init in graph.initializer if init.name in used]
    removed = len(graph.initializer) - len(kept)
    if removed:
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return removed


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names read inside If/Loop/Scan bodies, which may refer to outer-scope initializers."""
    return {name for node in graph.node for name in subgraph_reads(node)}


def _onnx_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)


def _infer_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """The model with the types and shapes ONNX infers in its main graph (bodies keep their annotations as given)."""
    try:
        inferred = infer_through_contrib_ops(model, _onnx_inference)
    except Exception as e:  # noqa: BLE001 - inference is best effort: a failure only costs type information
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("ONNX shape inference failed, continuing without it: %s", message)
        return model, message
    # nothing reads a body's annotations, and the written model would carry them (hundreds of entries in a model
    # of If bodies): each body keeps the ones it came with, its outputs' too (data propagation can fix a branch
    # output to the size of one export's example, which onnxruntime then allocates: a merged decoder)
    for before, after in zip(all_subgraphs(model.graph), all_subgraphs(inferred.graph), strict=True):
        for kept, inferred_field in ((before.value_info, after.value_info), (before.output, after.output)):
            del inferred_field[:]
            inferred_field.extend(kept)
    return inferred, None
