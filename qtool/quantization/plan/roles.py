"""What each quantizable op reads as activation, weight and bias, and how much work it does.

A plain op-type -> handler dict (:data:`HANDLERS`) decides the roles; :class:`~qtool.graph.index.GraphView`
holds the lookups they need (constants, types, shapes, consumers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from qtool.graph.index import GraphView
from qtool.numerics.saturation import COLUMNS, CONV, DEPTHWISE, ROWS

# op -> the kernel onnxruntime's QDQ transformers fuse DQ -> op -> Q into (CPU provider)
FUSED_KERNELS = {
    "Add": "QLinearAdd",
    "Mul": "QLinearMul",
    "Sigmoid": "QLinearSigmoid",
    "LeakyRelu": "QLinearLeakyRelu",
    "Concat": "QLinearConcat",
    "AveragePool": "QLinearAveragePool",
    "GlobalAveragePool": "QLinearGlobalAveragePool",
    "Softmax": "QLinearSoftmax",
}

# ops with 8-bit kernels that only move or select values: DQ -> op -> Q with one scale becomes the op on integers
PASS_THROUGH = frozenset(
    {"MaxPool", "Resize", "Reshape", "Transpose", "Split", "Slice", "Flatten", "Squeeze", "Unsqueeze"}
)

CHAIN_OPS = frozenset(FUSED_KERNELS) | PASS_THROUGH


def folds_into_quantizer(node: onnx.NodeProto, g: GraphView) -> bool:
    """Whether onnxruntime removes ``node`` before the QuantizeLinear of its output, so the node before it fuses.

    A Relu, when the quantizer's zero point is the type's minimum (``ReluQuantRewrite``); a Clip from 0 (ReLU6,
    a Relu written as Clip), when the quantizer's grid lies within its bounds (``ClipQuantRewrite``: the planned
    grid of a Clip's output never passes its upper bound, see :attr:`QuantPlan.ceilings`).
    """
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return False
    if node.op_type == "Relu":
        return True
    if node.op_type != "Clip":
        return False
    low, high = g.clip_bounds(node)
    unknown_high = len(node.input) > 2 and bool(node.input[2]) and high is None  # a bound computed at run time
    return low == 0.0 and not unknown_high and (high is None or high > 0.0)


def clip_ceilings(g: GraphView, tensors: Iterable[str]) -> dict[str, float]:
    """Of ``tensors``, those a Clip with a constant upper bound writes, and that bound."""
    found = {}
    for tensor in tensors:
        clip = g.producer(tensor)
        high = g.clip_bounds(clip)[1] if clip is not None and clip.op_type == "Clip" else None
        if high is not None:
            found[tensor] = high
    return found


@dataclass(frozen=True)
class WeightRoles:
    """A constant weight and its natural axes: output channels, and the reduction (block) axis."""

    name: str
    channel_axis: int | None
    block_axis: int | None


@dataclass(frozen=True)
class Roles:
    """What one node reads as activations, weight and bias."""

    activations: tuple[str, ...]
    weight: WeightRoles | None
    bias: str | None


def fed_at_run_time(what: str, name: str) -> str:
    """Why a node whose weight is a graph input stays float."""
    return f"{what} {name} is a graph input, not a constant: weights fed at run time are not quantized, node left float"


def _conv_roles(node: onnx.NodeProto, g: GraphView) -> Roles | str:
    if node.input[1] in g.graph_inputs:
        return fed_at_run_time("the weight", node.input[1])
    if node.input[1] not in g.initializers:
        return "the weight is not a constant initializer"
    bias = node.input[2] if len(node.input) > 2 and node.input[2] in g.initializers else None
    return Roles((node.input[0],), WeightRoles(node.input[1], 0, 1), bias)


def _conv_transpose_roles(node: onnx.NodeProto, g: GraphView) -> Roles | str:
    if node.input[1] in g.graph_inputs:
        return fed_at_run_time("the weight", node.input[1])
    if node.input[1] not in g.initializers:
        return "the weight is not a constant initializer"
    # The weight is [C_in, C_out / group, kH, kW]: output channels lie along axis 1, the reduction along 0.
    # With groups, axis 1 holds C_out / group scales, not one per output channel, so an int32 bias
    # (scaled per output channel) would not match: it stays float then.
    bias = node.input[2] if len(node.input) > 2 and node.input[2] in g.initializers else None
    return Roles((node.input[0],), WeightRoles(node.input[1], 1, 0), bias if node_group(node) == 1 else None)


def _gemm_roles(node: onnx.NodeProto, g: GraphView) -> Roles | str:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.input[1] in g.graph_inputs:
        return fed_at_run_time("input B", node.input[1])
    if node.input[1] not in g.initializers:
        return "input B is not a constant initializer"
    axis, reduction = (0, 1) if attrs.get("transB", 0) else (1, 0)
    bias = None
    if len(node.input) > 2 and node.input[2] in g.initializers:
        c = g.initializers[node.input[2]]
        n_out = g.initializers[node.input[1]].dims[axis]
        if attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and list(c.dims) == [n_out]:
            bias = node.input[2]
    return Roles((node.input[0],), WeightRoles(node.input[1], axis, reduction), bias)


def _matmul_roles(node: onnx.NodeProto, g: GraphView) -> Roles | str:
    a, b = node.input[0], node.input[1]
    if b in g.initializers:
        rank = g.rank(b)
        # B is [..., K, N]: output columns are the last axis, the reduction runs along K. A stack of
        # matrices (rank > 2) is quantized per tensor: per-column scales would have to be [..., 1, N],
        # which a DequantizeLinear axis cannot express, and onnxruntime fuses a 1-D [N] one into a
        # QLinearMatMul that then fails at run time.
        return Roles((a,), WeightRoles(b, rank - 1 if rank == 2 else None, rank - 2 if rank >= 2 else 0), None)
    if a in g.initializers:
        return Roles((b,), WeightRoles(a, None, g.rank(a) - 1), None)
    if b in g.graph_inputs:
        # MatMul(x, w) with w fed by the caller is a layer whose weights live outside the model, not a
        # product of two activations: its calibration range says nothing about the weights used later.
        return fed_at_run_time("input B", b)
    return Roles((a, b), None, None)


def _gather_roles(node: onnx.NodeProto, g: GraphView) -> Roles | str | None:
    """An embedding lookup: rows of a constant table [rows, width, ...] picked by run-time indices."""
    table = node.input[0]
    if table in g.elem_types and not g.is_float(table):
        return None  # a Gather of indices or of a shape (int64): not a table of weights
    if table in g.graph_inputs:
        return fed_at_run_time("the table", table)
    if table not in g.initializers:
        return None  # a Gather of values computed at run time: not a table of weights
    values = math.prod(g.initializers[table].dims)
    if values < LOOKUP_MIN_VALUES:
        return f"a table of {values} values: too small for storing it quantized to pay"
    rank = g.rank(table)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    if rank < 2 or axis % rank != 0:
        return "only row lookups (axis 0) in a table of rank 2 or more are quantized"
    # One scale per row (the natural axis); blocks run along each row's width.
    return Roles((), WeightRoles(table, 0, 1 if rank == 2 else None), None)


HANDLERS: dict[str, Callable[[onnx.NodeProto, GraphView], Roles | str | None]] = {
    "Conv": _conv_roles,
    "ConvTranspose": _conv_transpose_roles,
    "Gemm": _gemm_roles,
    "MatMul": _matmul_roles,
    "Gather": _gather_roles,
}


def has_constant_weight(node: onnx.NodeProto, g: GraphView) -> bool:
    """Whether ``node`` is one qtool quantizes with a constant weight (a Conv, Gemm, MatMul or a table lookup)."""
    handler = HANDLERS.get(node.op_type)
    roles = handler(node, g) if handler is not None and len(node.input) >= 2 else None
    return roles is not None and not isinstance(roles, str) and roles.weight is not None


# Ops that only read their weight, with no integer kernel: always stored quantized and restored at load.
LOOKUP_OPS = frozenset({"Gather"})
# A smaller table saves at most 12 KB stored 8-bit, but a row added to every token (BERT's two-row token type
# table, one of whose dimensions is 50 times the others) costs accuracy for it: it stays float.
LOOKUP_MIN_VALUES = 4096


def _sole_consumer(tensor: str, g: GraphView) -> onnx.NodeProto | None:
    users = g.consumers.get(tensor, [])
    return users[0] if tensor not in g.graph_outputs and len(users) == 1 else None


def output_to_quantize(node: onnx.NodeProto, g: GraphView) -> str | None:
    """The tensor to quantize after ``node``: past a bias Add (MatMul) and a Relu or ReLU6 it alone feeds.

    Quantizing after the bias keeps the MatMul's raw output in float (onnxruntime
    runs DQ -> MatMul -> Add as one integer kernel with a float bias) instead of
    rounding it once more before the bias is added.
    """
    out = node.output[0]
    if not g.is_float(out) and out in g.elem_types:
        return None
    user = _sole_consumer(out, g)
    if node.op_type == "MatMul" and user is not None and user.op_type == "Add":
        other = user.input[1] if user.input[0] == out else user.input[0]
        if other in g.initializers and len(g.initializers[other].dims) == 1:
            out = user.output[0]
            user = _sole_consumer(out, g)
    if user is not None and folds_into_quantizer(user, g):
        return user.output[0]
    return out


def node_macs(node: onnx.NodeProto, roles: Roles, g: GraphView, elements: dict[str, int]) -> int | None:
    """Multiply-accumulates per sample, from the output's element count and the reduction length."""
    if node.op_type == "ConvTranspose":
        # Every input value is multiplied by the C_out / group x kH x kW weights of its channel.
        inp = elements.get(roles.activations[0]) if roles.weight is not None else None
        weight_dims = list(g.initializers[roles.weight.name].dims) if roles.weight is not None else []
        return inp * int(np.prod(weight_dims[1:])) if inp else None
    out = elements.get(node.output[0])
    if out is None and roles.weight is not None and elements.get(roles.activations[0]):
        # Only the input was observed: Conv output ~ input / C_in * C_out (exact at stride 1),
        # MatMul/Gemm output = input / K * N.
        dims = list(g.initializers[roles.weight.name].dims)
        channel, reduction = roles.weight.channel_axis, roles.weight.block_axis
        if channel is not None and reduction is not None and len(dims) >= 2:
            width = dims[1] * node_group(node) if node.op_type == "Conv" else dims[reduction]
            out = elements[roles.activations[0]] // max(width, 1) * dims[channel]
    if out is None:
        return None
    if roles.weight is not None:
        dims = list(g.initializers[roles.weight.name].dims)
        if node.op_type == "Conv":
            reduction = int(np.prod(dims[1:]))
        elif roles.weight.block_axis is not None and roles.weight.block_axis < len(dims):
            reduction = dims[roles.weight.block_axis]
        else:
            return None
        return out * reduction
    shape = g.shapes.get(node.input[0])
    if shape and isinstance(shape[-1], int):
        return out * shape[-1]
    return None


def node_group(node: onnx.NodeProto) -> int:
    """A Conv's or ConvTranspose's ``group`` attribute (1 when absent)."""
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def is_depthwise(node: onnx.NodeProto, roles: Roles, g: GraphView) -> bool:
    """A Conv with one input channel per group (int8 kernels gain nothing there)."""
    if node.op_type != "Conv" or roles.weight is None:
        return False
    group = node_group(node)
    return group > 1 and g.initializers[roles.weight.name].dims[1] == 1


def static_elements(model: onnx.ModelProto) -> dict[str, int]:
    """Per-sample element counts of tensors whose shapes shape inference fixed (a symbolic batch counts as 1)."""
    counts: dict[str, int] = {}
    for value in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        if not (value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        if dims and dims[0] is None:
            dims[0] = 1
        known = [d for d in dims if isinstance(d, int) and d > 0]
        if len(known) == len(dims):
            counts[value.name] = int(np.prod(known)) if known else 1
    return counts


def pair_layout(node: onnx.NodeProto, roles: Roles, g: GraphView) -> str | None:
    """How onnxruntime's integer kernel for ``node`` pairs its weight, or None when qtool does not know it."""
    if roles.weight is None:
        return None
    weight = g.initializers.get(roles.weight.name)
    if weight is None:
        return None
    dims = list(weight.dims)
    if node.op_type == "Conv" and len(dims) >= 3:
        group = node_group(node)
        return DEPTHWISE if dims[1] == 1 and dims[0] == group else CONV
    if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] == roles.weight.name and len(dims) >= 2:
        return COLUMNS
    if node.op_type == "Gemm" and len(dims) == 2:
        return ROWS if roles.weight.channel_axis == 0 else COLUMNS
    return None  # ConvTranspose, a MatMul whose constant is its first input: not analysed
