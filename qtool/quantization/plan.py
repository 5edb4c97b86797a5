"""Model + config -> quantization plan: which nodes, weights, biases and activations get quantized.

The plan is the contract between the stages: ``calibrate`` observes the plan's
activation tensors, and ``rewrite`` inserts Q/DQ for exactly what it lists.
A plain op-type -> handler dict decides what each quantizable op reads as
activation, weight and bias.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import TensorProto, helper

from qtool.config import NodeScheme, QConfig, TensorScheme
from qtool.errors import QtoolError
from qtool.graph.prepare import all_nodes, node_subgraphs, subgraph_reads

log = logging.getLogger(__name__)

# Ops whose output may be folded into the quantized node's output: onnxruntime
# removes a Relu that feeds a QuantizeLinear with zero point at the type's minimum.
_FUSABLE_ACTIVATIONS = {"Relu"}


@dataclass(frozen=True)
class WeightPlan:
    """A constant weight input: its initializer and where its scales lie.

    ``axis`` None means one scale for the tensor; with ``block_size`` None it is
    one scale per slice along ``axis`` (per channel), otherwise one per block of
    ``block_size`` elements along ``axis``.
    """

    name: str
    axis: int | None
    block_size: int | None = None


@dataclass(frozen=True)
class _WeightRoles:
    """A constant weight and its natural axes: output channels, and the reduction (block) axis."""

    name: str
    channel_axis: int | None
    block_axis: int | None


@dataclass(frozen=True)
class NodePlan:
    """How one node is quantized."""

    name: str
    op_type: str
    scheme: NodeScheme
    activations: tuple[str, ...]  # float inputs quantized per tensor
    weight: WeightPlan | None
    bias: str | None  # 1-D initializer quantized to int32 (needs activations[0] and weight)
    output: str | None  # tensor quantized after the node (after a folded Relu)
    placement: str = "integer"  # "integer" (Q/DQ), "storage" (restored to float at load) or "weight_only"
    reason: str = ""  # why this placement
    macs: int | None = None  # multiply-accumulates per sample (integer nodes, when sizes are known)

    @property
    def reduced_weight_range(self) -> bool:
        """Whether the int8 weight is stored in [-64, 63] (``weight.saturation``; see :func:`guard_saturation`)."""
        return (
            self.placement == "integer"
            and bool(self.activations)
            and self.scheme.weight.dtype == "int8"
            and self.scheme.activation.dtype in _U8S8_ACTIVATIONS
            and (
                self.scheme.weight.saturation == "reduce_range"
                or (self.scheme.weight.saturation == "uint8" and self.scheme.activation.dtype == "int8")
            )
        )


# x86 CPUs without VNNI (AVX2; AVX-512 before Cascade Lake; AMD before Zen 4) multiply 8-bit activations
# by int8 weights with VPMADDUBSW, which adds two products in int16 and saturates: 255 x 127 x 2
# overflows. onnxruntime runs such kernels for integer-placed nodes with these activation dtypes.
_U8S8_ACTIVATIONS = ("uint8", "int8")


def guard_saturation(scheme: NodeScheme) -> NodeScheme:
    """The scheme an integer-placed node is quantized with, given ``weight.saturation``.

    ``uint8`` (default) stores int8 weights as uint8 with the same number of levels, so onnxruntime
    runs its exact uint8 x uint8 kernels on every CPU (measured: 1-5 % slower than int8 on AVX2).
    With int8 activations there is no such kernel, and the weights get the reduced range instead.
    ``reduce_range`` keeps int8 in [-64, 63] (fastest everywhere, one bit less); ``ignore`` keeps the
    full range, for VNNI or ARM deployments only.
    """
    weight = scheme.weight
    if weight.saturation == "uint8" and weight.dtype == "int8" and scheme.activation.dtype == "uint8":
        return replace(scheme, weight=replace(weight, dtype="uint8"))
    return scheme


@dataclass(frozen=True)
class QuantPlan:
    """Every quantization decision for one model."""

    nodes: tuple[NodePlan, ...]
    activations: dict[str, TensorScheme]  # tensor -> scheme, in first-use order
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (node, reason) left in float

    @property
    def uses_per_channel(self) -> bool:
        return any(n.weight is not None and n.weight.axis is not None for n in self.nodes)


@dataclass(frozen=True)
class _Roles:
    activations: tuple[str, ...]
    weight: _WeightRoles | None
    bias: str | None


class _Graph:
    """Lookup tables over a graph that the handlers need."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.inputs = {i.name for i in graph.input}
        # An initializer that is also a graph input can be overridden at run time: not a constant.
        self.initializers = {i.name: i for i in graph.initializer if i.name not in self.inputs}
        self.graph_outputs = {o.name for o in graph.output}
        self.elem_types: dict[str, int] = {}
        for value in [*graph.input, *graph.value_info, *graph.output]:
            if value.type.HasField("tensor_type"):
                self.elem_types[value.name] = value.type.tensor_type.elem_type
        for init in graph.initializer:
            self.elem_types[init.name] = init.data_type
        self.shapes: dict[str, list[int | str]] = {}
        for value in [*graph.input, *graph.value_info, *graph.output]:
            if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
                self.shapes[value.name] = [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]
        self.nodes = list(graph.node)
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            # an If/Loop/Scan also reads, implicitly, every outer tensor its bodies use
            for name in dict.fromkeys([*node.input, *sorted(subgraph_reads(node))]):
                if name:
                    self.consumers.setdefault(name, []).append(node)

    def is_float(self, name: str) -> bool:
        return self.elem_types.get(name) == TensorProto.FLOAT

    def rank(self, name: str) -> int:
        return len(self.initializers[name].dims)


def _fed_at_run_time(what: str, name: str) -> str:
    """Why a node whose weight is a graph input stays float."""
    return f"{what} {name} is a graph input, not a constant: weights fed at run time are not quantized, node left float"


def _conv_roles(node: onnx.NodeProto, g: _Graph) -> _Roles | str:
    if node.input[1] in g.inputs:
        return _fed_at_run_time("the weight", node.input[1])
    if node.input[1] not in g.initializers:
        return "the weight is not a constant initializer"
    bias = node.input[2] if len(node.input) > 2 and node.input[2] in g.initializers else None
    return _Roles((node.input[0],), _WeightRoles(node.input[1], 0, 1), bias)


def _conv_transpose_roles(node: onnx.NodeProto, g: _Graph) -> _Roles | str:
    if node.input[1] in g.inputs:
        return _fed_at_run_time("the weight", node.input[1])
    if node.input[1] not in g.initializers:
        return "the weight is not a constant initializer"
    # The weight is [C_in, C_out / group, kH, kW]: output channels lie along axis 1, the reduction along 0.
    # With groups, axis 1 holds C_out / group scales, not one per output channel, so an int32 bias
    # (scaled per output channel) would not match: it stays float then.
    bias = node.input[2] if len(node.input) > 2 and node.input[2] in g.initializers else None
    return _Roles((node.input[0],), _WeightRoles(node.input[1], 1, 0), bias if node_group(node) == 1 else None)


def _gemm_roles(node: onnx.NodeProto, g: _Graph) -> _Roles | str:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.input[1] in g.inputs:
        return _fed_at_run_time("input B", node.input[1])
    if node.input[1] not in g.initializers:
        return "input B is not a constant initializer"
    axis, reduction = (0, 1) if attrs.get("transB", 0) else (1, 0)
    bias = None
    if len(node.input) > 2 and node.input[2] in g.initializers:
        c = g.initializers[node.input[2]]
        n_out = g.initializers[node.input[1]].dims[axis]
        if attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and list(c.dims) == [n_out]:
            bias = node.input[2]
    return _Roles((node.input[0],), _WeightRoles(node.input[1], axis, reduction), bias)


def _matmul_roles(node: onnx.NodeProto, g: _Graph) -> _Roles | str:
    a, b = node.input[0], node.input[1]
    if b in g.initializers:
        rank = g.rank(b)
        # B is [..., K, N]: output columns are the last axis, the reduction runs along K. A stack of
        # matrices (rank > 2) is quantized per tensor: per-column scales would have to be [..., 1, N],
        # which a DequantizeLinear axis cannot express, and onnxruntime fuses a 1-D [N] one into a
        # QLinearMatMul that then fails at run time.
        return _Roles((a,), _WeightRoles(b, rank - 1 if rank == 2 else None, rank - 2 if rank >= 2 else 0), None)
    if a in g.initializers:
        return _Roles((b,), _WeightRoles(a, None, g.rank(a) - 1), None)
    if b in g.inputs:
        # MatMul(x, w) with w fed by the caller is a layer whose weights live outside the model, not a
        # product of two activations: its calibration range says nothing about the weights used later.
        return _fed_at_run_time("input B", b)
    return _Roles((a, b), None, None)


HANDLERS: dict[str, Callable[[onnx.NodeProto, _Graph], _Roles | str]] = {
    "Conv": _conv_roles,
    "ConvTranspose": _conv_transpose_roles,
    "Gemm": _gemm_roles,
    "MatMul": _matmul_roles,
}


def runs_weight_only(spec: TensorScheme) -> bool:
    """Weights stored this way run with float activations.

    fp16 weights are cast back to float. Block-wise weights have no integer
    kernel with quantized activations; on MatMul onnxruntime turns them into
    MatMulNBits, which takes float activations. (4- and 2-bit weights per tensor
    or per channel do get quantized activations: they are widened to 8 bits by a
    Cast that onnxruntime folds at load, then run in the int8 kernels.)
    """
    return spec.fp16 or spec.per_block


def _sole_consumer(tensor: str, g: _Graph) -> onnx.NodeProto | None:
    users = g.consumers.get(tensor, [])
    return users[0] if tensor not in g.graph_outputs and len(users) == 1 else None


def _output_to_quantize(node: onnx.NodeProto, g: _Graph) -> str | None:
    """The tensor to quantize after ``node``: past a bias Add (MatMul) and a Relu it alone feeds.

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
    if user is not None and user.op_type in _FUSABLE_ACTIVATIONS:
        return user.output[0]
    return out


# A node runs as an integer kernel under placement "auto" only when it does at least this many
# multiply-accumulates per sample: below it, onnxruntime spends more on Quantize/DequantizeLinear and
# kernel dispatch than the int8 kernel saves (the sample MLP and transformer run 0.7x with every
# node integer; the sample CNN, whose convolutions are 0.9-4.7 M MACs, 1.4x).
AUTO_MIN_MACS = 500_000
# ... and only when it does at least this many multiply-accumulates per value that must cross between a
# float and an integer region for it (a QuantizeLinear on an input a float node wrote, a
# DequantizeLinear on an output a float node reads). Chains of integer nodes pay at their ends only;
# an isolated pointwise convolution in a MobileNetV3 block (HardSwish on both sides) pays both ways.
AUTO_MIN_INTENSITY = 48


def _node_macs(node: onnx.NodeProto, roles: _Roles, g: _Graph, elements: dict[str, int]) -> int | None:
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


def _is_depthwise(node: onnx.NodeProto, roles: _Roles, g: _Graph) -> bool:
    if node.op_type != "Conv" or roles.weight is None:
        return False
    group = node_group(node)
    return group > 1 and g.initializers[roles.weight.name].dims[1] == 1


def _placement(
    node: onnx.NodeProto, roles: _Roles, scheme: NodeScheme, g: _Graph, elements: dict[str, int] | None
) -> tuple[str, str]:
    """("integer" | "storage" | "float", why) for one node."""
    if scheme.placement == "integer":
        return "integer", f"placement: integer ({scheme.rule})"
    if scheme.placement == "storage":
        return "storage", f"placement: storage ({scheme.rule})"
    if elements is None:
        return "integer", "auto without tensor sizes (decided when quantizing with data)"
    if _is_depthwise(node, roles, g):
        return "storage", "auto: depthwise convolution does too little work per value for int8 kernels"
    if node.op_type == "ConvTranspose":
        return "storage", "auto: onnxruntime (CPU) has no integer ConvTranspose kernel"
    macs = _node_macs(node, roles, g, elements)
    if macs is None:
        return "integer", "auto: size unknown, integer kernel assumed"
    if macs < AUTO_MIN_MACS:
        small = f"{macs:,} MACs per sample < {AUTO_MIN_MACS:,}, Q/DQ would cost more than int8 saves"
        # without a constant weight there is nothing to store: the node simply stays float
        return ("storage", f"auto: {small}") if roles.weight is not None else ("float", f"auto: kept float, {small}")
    return "integer", f"auto: {macs:,} MACs per sample"


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


def build_plan(model: onnx.ModelProto, config: QConfig, elements: dict[str, int] | None = None) -> QuantPlan:
    """Decide, node by node, what to quantize (see :class:`QuantPlan`).

    ``model`` should be the prepared model (see :func:`qtool.graph.prepare.prepare_model`)
    so that tensor types are known. ``elements`` (per-sample element counts of
    tensors, from calibration or static shapes) lets ``placement: auto`` choose
    between integer kernels and storage-only compression; without it every
    auto node is planned as integer, so calibration observes everything it may need.
    """
    g = _Graph(model)
    plan = _plan_nodes(model, config, g, elements, {})
    demoted = _isolated_integer_nodes(plan, g, elements) if elements is not None else {}
    return _plan_nodes(model, config, g, elements, demoted) if demoted else plan


# Ops onnxruntime runs on the quantized values between integer kernels (or that only move data):
# a tensor that reaches an integer node through them crosses no float/integer boundary.
_TRANSPARENT = {"MaxPool", "Relu", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"}


def _isolated_integer_nodes(plan: QuantPlan, g: _Graph, elements: dict[str, int]) -> dict[str, str]:
    """Auto-placed integer nodes whose work per value crossing a float/integer boundary is too low.

    Demoting a node turns its neighbours' shared tensors into boundaries, so this repeats until
    no node falls below :data:`AUTO_MIN_INTENSITY`.
    """
    source: dict[str, str] = {}  # a transparent op's output -> its data input
    for node in g.nodes:
        if node.op_type in _TRANSPARENT and node.input and node.output:
            source[node.output[0]] = node.input[0]

    def origin(tensor: str) -> str:
        while tensor in source:
            tensor = source[tensor]
        return tensor

    def readers(tensor: str) -> list[tuple[str, str]]:
        """(node, tensor) for every non-transparent reader, looking through transparent ops."""
        found = []
        for user in g.consumers.get(tensor, []):
            if user.op_type in _TRANSPARENT and user.input[0] == tensor:
                found += readers(user.output[0]) if user.output[0] not in g.graph_outputs else [("", tensor)]
            else:
                found.append((user.name, tensor))
        return found

    integer = {n.name: n for n in plan.nodes if n.placement == "integer"}
    demoted: dict[str, str] = {}
    while True:
        fed = {origin(n.output) for n in integer.values() if n.output}
        newly = {}
        for node in integer.values():
            if node.scheme.placement != "auto" or node.macs is None:
                continue
            crossing = sum(elements.get(t, 0) for t in node.activations if origin(t) not in fed)
            out = node.output
            if out and (
                out in g.graph_outputs
                or any(name not in integer or t not in integer[name].activations for name, t in readers(out))
            ):
                crossing += elements.get(out, 0)
            if crossing and node.macs < AUTO_MIN_INTENSITY * crossing:
                newly[node.name] = (
                    f"auto: {node.macs / crossing:.0f} MACs per value converted at its float/integer "
                    f"boundaries < {AUTO_MIN_INTENSITY}, Q/DQ would cost more than int8 saves"
                )
        if not newly:
            return demoted
        demoted.update(newly)
        for name in newly:
            del integer[name]


def _plan_nodes(
    model: onnx.ModelProto, config: QConfig, g: _Graph, elements: dict[str, int] | None, demoted: dict[str, str]
) -> QuantPlan:
    nodes: list[NodePlan] = []
    activations: dict[str, TensorScheme] = {}
    skipped: list[tuple[str, str]] = []
    for node in model.graph.node:
        bodies = node_subgraphs(node)
        if bodies:
            skipped.append((node.name, _bodies_left_float(node, bodies)))
            continue
        handler = HANDLERS.get(node.op_type)
        if handler is None or node.domain not in ("", "ai.onnx"):
            continue
        name = node.name
        scheme = config.scheme_for(name, node.op_type)
        if scheme is None:
            skipped.append((name, "kept in float by the config"))
            continue
        roles = handler(node, g) if len(node.input) >= 2 else "it has fewer than two inputs"
        if isinstance(roles, str):
            skipped.append((name, roles))
            continue
        unknown = [t for t in roles.activations if t not in g.elem_types]
        if unknown:
            skipped.append((name, f"the type of input {unknown[0]} is unknown (shape inference could not tell)"))
            continue
        not_float = [t for t in roles.activations if not g.is_float(t)]
        if roles.weight and g.initializers[roles.weight.name].data_type != TensorProto.FLOAT:
            not_float.append(roles.weight.name)
        if not_float:
            skipped.append((name, f"input {not_float[0]} is not float32"))
            continue
        if roles.weight and 0 in g.initializers[roles.weight.name].dims:
            skipped.append((name, f"its weight {roles.weight.name} is empty"))
            continue
        float_activations = scheme.weight_only or runs_weight_only(scheme.weight)
        weight = _weight_plan(roles.weight, scheme, g, name) if roles.weight else None
        if float_activations:
            if weight is None:
                skipped.append((name, "weight_only/fp16 asked for, but the node has no constant weight"))
                continue
            why = "fp16" if scheme.weight.fp16 else "per_block weights" if weight.block_size else "weight_only"
            nodes.append(NodePlan(name, node.op_type, scheme, (), weight, None, None, "weight_only", why))
            continue
        placement, why = _placement(node, roles, scheme, g, elements)
        if name in demoted:
            placement, why = ("storage" if weight is not None else "float"), demoted[name]
        if placement == "float":
            skipped.append((name, why))
            continue
        if placement == "storage":
            nodes.append(NodePlan(name, node.op_type, scheme, (), weight, None, None, "storage", why))
            continue
        output = _output_to_quantize(node, g)
        for tensor in (*roles.activations, *([output] if output else [])):
            chosen = activations.setdefault(tensor, scheme.activation)
            if chosen != scheme.activation:
                log.warning(
                    "tensor %s: node %s asks for %s, but an earlier reader already set %s (first use wins)",
                    tensor,
                    name,
                    scheme.activation.describe() + f" observer={scheme.activation.observer}",
                    chosen.describe() + f" observer={chosen.observer}",
                )
        # An int32 bias needs one weight scale per output channel (or one for all): not per block.
        natural = roles.weight.channel_axis if roles.weight else None
        bias_fits = weight is not None and weight.block_size is None and weight.axis in (None, natural)
        bias = roles.bias if bias_fits else None
        macs = _node_macs(node, roles, g, elements) if elements is not None else None
        integer = guard_saturation(scheme)
        nodes.append(
            NodePlan(name, node.op_type, integer, roles.activations, weight, bias, output, "integer", why, macs)
        )
    return QuantPlan(tuple(nodes), activations, tuple(skipped))


def _bodies_left_float(node: onnx.NodeProto, bodies: list[onnx.GraphProto]) -> str:
    """Why an If/Loop/Scan is left as it is.

    Calibration can only observe tensors of the main graph (a body's tensors cannot be graph
    outputs), so qtool quantizes no node inside a body; what a body reads from the outer scope
    stays available in float (see :mod:`qtool.quantization.rewrite`).
    """
    count = sum(len(all_nodes(body)) for body in bodies)
    where = f"{node.op_type} {'bodies' if len(bodies) > 1 else 'body'}"
    return f"{count} node{'' if count == 1 else 's'} inside its {where} left float (qtool does not quantize subgraphs)"


def passthrough_ops(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, int]:
    """Op type -> number of main-graph nodes qtool has no quantization for and leaves untouched."""
    decided = {n.name for n in plan.nodes} | {name for name, _ in plan.skipped}
    counts = Counter(n.op_type for n in model.graph.node if n.name not in decided and n.op_type not in HANDLERS)
    return dict(sorted(counts.items()))


def _weight_plan(roles: _WeightRoles, scheme: NodeScheme, g: _Graph, node: str) -> WeightPlan:
    """Where the weight's scales lie, from the scheme's granularity and the op's natural axes."""
    spec = scheme.weight
    if spec.fp16 or spec.granularity == "per_tensor":
        return WeightPlan(roles.name, None)
    natural = roles.block_axis if spec.per_block else roles.channel_axis
    if natural is None and spec.axis is not None and not spec.per_block:
        # A stack of matrices, or a constant on MatMul's left: onnxruntime's integer MatMul takes no
        # per-channel scales there, and the model would load but fail when run.
        raise QtoolError(
            f"node {node}: weight {roles.name} has no per-channel axis onnxruntime can run (axis {spec.axis} asked)",
            hint=f"use granularity: per_tensor for it (rule {scheme.rule})",
        )
    axis = spec.axis if spec.axis is not None else natural
    if axis is None:
        log.info("%s: %s weights along no axis; using per_tensor", node, spec.granularity)
        return WeightPlan(roles.name, None)
    rank = g.rank(roles.name)
    if not -rank <= axis < rank:
        raise QtoolError(
            f"node {node}: weight axis {axis} is out of range for weight {roles.name} of rank {rank}",
            hint=f"set axis between {-rank} and {rank - 1} (rule {scheme.rule})",
        )
    axis %= rank
    return WeightPlan(roles.name, axis, (spec.block_size or 32) if spec.per_block else None)
