"""Model + config -> quantization plan: which nodes, weights, biases and activations get quantized.

The plan is the contract between the stages: ``calibrate`` observes the plan's
activation tensors, and ``rewrite`` inserts Q/DQ for exactly what it lists.
A plain op-type -> handler dict decides what each quantizable op reads as
activation, weight and bias.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import onnx
from onnx import TensorProto, helper

from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.graph.index import GraphView, node_subgraphs
from qtool.numerics.qparams import quant_type
from qtool.quantization.plan.bodies import bodies_note, plan_body_weights
from qtool.quantization.plan.branches import with_branches
from qtool.quantization.plan.chains import plan_chains
from qtool.quantization.plan.nbits_form import int2_fusion_fault, nbits_fallback
from qtool.quantization.plan.outputs import REASON as FLOAT_OUTPUT_REASON
from qtool.quantization.plan.outputs import writes_float_output
from qtool.quantization.plan.placement import isolated_integer_nodes, node_placement
from qtool.quantization.plan.records import NodePlan, QuantPlan, WeightPlan
from qtool.quantization.plan.recurrent import plan_recurrent_weights
from qtool.quantization.plan.roles import (
    HANDLERS,
    LOOKUP_OPS,
    Roles,
    WeightRoles,
    clip_ceilings,
    has_constant_weight,
    node_macs,
    output_to_quantize,
    pair_layout,
)
from qtool.schemes import CPU_TARGETS, NodeScheme, TensorScheme, for_target

log = logging.getLogger(__name__)


def guard_saturation(scheme: NodeScheme, layout: str | None) -> NodeScheme:
    """The scheme an integer-placed node is quantized with, given ``weight.saturation``.

    ``auto`` (default) becomes ``fit`` where qtool knows how the node's kernel pairs its weights
    (``layout``, see :mod:`qtool.numerics.saturation`) and the weights are symmetric int8: the
    rewrite then keeps full-range int8 where no pair can saturate and fits the channels that could.
    Elsewhere it falls back to ``uint8``, which stores int8 weights as uint8 with the same levels, so
    onnxruntime runs its exact uint8 x uint8 kernels on every CPU (slower on VNNI CPUs). With int8
    activations there is no such kernel, and the weights get the reduced range instead.
    ``reduce_range`` keeps int8 in [-64, 63] (one bit less); ``ignore`` keeps the full range, for VNNI or
    ARM deployments only.
    """
    weight = scheme.weight
    if weight.saturation == "auto":
        fits = layout is not None and weight.dtype == "int8" and weight.symmetric
        weight = replace(weight, saturation="fit" if fits else "uint8")
        scheme = replace(scheme, weight=weight)
    if weight.saturation == "uint8" and weight.dtype == "int8" and scheme.activation.dtype == "uint8":
        return replace(scheme, weight=replace(weight, dtype="uint8"))
    return scheme


def runs_weight_only(spec: TensorScheme) -> bool:
    """Weights stored this way run with float activations.

    fp16 weights are cast back to float. Block-wise weights have no integer
    kernel with quantized activations; on MatMul onnxruntime turns them into
    MatMulNBits, which takes float activations. (4- and 2-bit weights per tensor
    or per channel do get quantized activations: they are widened to 8 bits by a
    Cast that onnxruntime folds at load, then run in the int8 kernels.)
    """
    return spec.fp16 or spec.per_block


def build_plan(
    model: onnx.ModelProto,
    config: QConfig,
    elements: dict[str, int] | None = None,
    view: GraphView | None = None,
    observed: frozenset[str] | None = None,
    body: bool = False,
) -> QuantPlan:
    """Decide, node by node, what to quantize (see :class:`QuantPlan`).

    ``model`` should be the prepared model (see :func:`qtool.graph.prepare.prepare_model`)
    so that tensor types are known. ``elements`` (per-sample element counts of
    tensors, from calibration or static shapes) lets ``placement: auto`` choose
    between integer kernels and storage-only compression; without it every
    auto node is planned as integer, so calibration observes everything it may need.
    ``view`` is the model's :class:`GraphView`, when the caller holds one. ``observed``: the tensors
    calibration saw (see :mod:`qtool.quantization.plan.branches`). ``body``: ``model`` is an If/Loop body's (its
    outputs are not the model's: see :mod:`qtool.quantization.plan.outputs`).
    """
    g = view if view is not None else GraphView(model)
    demoted: dict[str, str] = {}
    while True:
        plan = _plan_nodes(model, config, g, (elements, body), demoted)
        # a demoted node's chains go with it, which can leave a neighbour isolated in turn: plan again
        newly = isolated_integer_nodes(plan, g, elements) if elements is not None else {}
        if not newly:
            return with_branches(plan, model, config, elements, g, observed, build_plan)
        demoted.update(newly)


def _plan_nodes(
    model: onnx.ModelProto,
    config: QConfig,
    g: GraphView,
    sizes: tuple[dict[str, int] | None, bool],
    demoted: dict[str, str],
) -> QuantPlan:
    elements, body = sizes
    nodes: list[NodePlan] = []
    activations: dict[str, TensorScheme] = {}
    skipped: list[tuple[str, str]] = []
    final = final_weighted_nodes(model, g)
    for node in model.graph.node:
        eligible = _eligible(node, config, g)
        if eligible is None:
            continue
        if isinstance(eligible, str):
            skipped.append((node.name, eligible))
            continue
        scheme, roles = eligible
        weight = _weight_plan(roles.weight, scheme, g, node.name) if roles.weight else None
        lookup = node.op_type in LOOKUP_OPS and weight is not None
        if lookup and not scheme.weight.fp8:
            # A lookup reads a few rows per call: the table stays quantized, the rows read are dequantized.
            why = "a table lookup: the rows it reads are dequantized after it"
            planned: NodePlan | str = NodePlan(node.name, node.op_type, scheme, (), weight, None, None, "lookup", why)
        elif scheme.weight_only or runs_weight_only(scheme.weight) or lookup:
            planned = _weight_only_node(node, scheme, weight, node.name in final, g, config.target in CPU_TARGETS)
        else:
            planned = _computing_node(node, roles, scheme, weight, g, elements, demoted.get(node.name))
        if isinstance(planned, str):
            skipped.append((node.name, planned))
            continue
        if not body and writes_float_output(planned, node, g, final):
            planned = replace(planned, output=None, reason=f"{planned.reason}; {FLOAT_OUTPUT_REASON}")
        nodes.append(planned)
        _claim_activations(activations, planned, scheme)
    shared: dict[str, str] = {}
    if config.target in CPU_TARGETS:
        chained, shared = plan_chains(g, config, [n for n in nodes if n.placement == "integer" and n.activations])
        nodes = _in_graph_order(g, [*nodes, *chained])
        for chain_node in chained:
            _claim_activations(activations, chain_node, chain_node.scheme)
        shared = {out: source for out, source in shared.items() if out in activations and source in activations}
    if config.target == "tensorrt":
        residual = for_target(config.global_scheme, "tensorrt").activation
        _quantize_residual_inputs(model, g, nodes, activations, residual)
    body_weights = plan_body_weights(g, config)
    recurrent = plan_recurrent_weights(g, config)
    return QuantPlan(
        tuple(nodes),
        activations,
        tuple(skipped),
        config.target,
        shared,
        body_weights,
        recurrent_weights=recurrent,
        ceilings=clip_ceilings(g, activations),
    )


def _in_graph_order(g: GraphView, nodes: list[NodePlan]) -> list[NodePlan]:
    return sorted(nodes, key=lambda n: g.positions.get(n.name, len(g.nodes)))


def _eligible(node: onnx.NodeProto, config: QConfig, g: GraphView) -> tuple[NodeScheme, Roles] | str | None:
    """The node's scheme and roles, why it stays float (a string), or None for an op qtool does not quantize."""
    if node_subgraphs(node):
        return bodies_note(node, g.initializers, config)
    handler = HANDLERS.get(node.op_type)
    if handler is None or node.domain not in ("", "ai.onnx"):
        return None
    scheme = config.scheme_for(node.name, node.op_type)
    if scheme is None:
        if node.name in config.float_nodes:
            return "kept in float by the sensitivity search (quantizing it cost the most accuracy)"
        return "kept in float by the config"
    roles = handler(node, g) if len(node.input) >= 2 else "it has fewer than two inputs"
    if roles is None or isinstance(roles, str):  # None: this instance is not what qtool quantizes (a shape Gather)
        return roles
    unknown = [t for t in roles.activations if t not in g.elem_types]
    if unknown:
        return f"the type of input {unknown[0]} is unknown (shape inference could not tell)"
    not_float = [t for t in roles.activations if not g.is_float(t)]
    if roles.weight and g.initializers[roles.weight.name].data_type != TensorProto.FLOAT:
        not_float.append(roles.weight.name)
    if not_float:
        kind = TensorProto.DataType.Name(g.elem_types.get(not_float[0], TensorProto.UNDEFINED)).lower()
        # no tensor name: a bfloat16 model's hundreds of nodes share this reason, and so one summary line
        return f"an input is {kind}, not float32 (qtool quantizes float32 and float16 models)"
    if roles.weight and 0 in g.initializers[roles.weight.name].dims:
        return f"its weight {roles.weight.name} is empty"
    return scheme, roles


def _weight_only_node(
    node: onnx.NodeProto, scheme: NodeScheme, weight: WeightPlan | None, final: bool, g: GraphView, cpu: bool
) -> NodePlan | str:
    """A node with float activations and its weight stored quantized (or why it cannot be).

    ``cpu``: the target runs onnxruntime's CPU kernels (see :func:`int2_fusion_fault`).
    """
    if weight is None:
        return "weight_only/fp16 asked for, but the node has no constant weight"
    why = "fp16" if scheme.weight.fp16 else "per_block weights" if weight.block_size else "weight_only"
    if node.op_type in LOOKUP_OPS:  # Gather takes no float8 input: the rows cannot be read as stored
        why = f"a {scheme.weight.dtype} table, dequantized whole before the lookup (Gather reads no float8)"
    if final and _keeps_final_int8(scheme):
        signed = quant_type(scheme.weight.dtype).signed
        scheme = replace(scheme, weight=replace(scheme.weight, dtype="int8" if signed else "uint8"))
        why += "; the final projection keeps int8 weights (weight.final_layer_int8)"
    if scheme.weight.format == "matmul_nbits":
        fallback = nbits_fallback(node, weight, scheme, g)
        if fallback:
            scheme = replace(scheme, weight=replace(scheme.weight, format="qdq"))
            why += f"; {fallback}"
    elif cpu and (fault := int2_fusion_fault(node, weight, scheme, g)):
        scheme = replace(scheme, weight=replace(scheme.weight, format="matmul_nbits"))
        why += f"; {fault}"
    return NodePlan(node.name, node.op_type, scheme, (), weight, None, None, "weight_only", why)


def _computing_node(
    node: onnx.NodeProto,
    roles: Roles,
    scheme: NodeScheme,
    weight: WeightPlan | None,
    g: GraphView,
    elements: dict[str, int] | None,
    demoted: str | None,
) -> NodePlan | str:
    """An integer, dynamic or storage node, as its placement decides (or why it stays float)."""
    name = node.name
    placement, why = node_placement(node, roles, scheme, g, elements)
    if demoted is not None:  # isolated_integer_nodes found too little work per boundary value
        placement, why = ("storage" if weight is not None else "float"), demoted
    if placement == "float":
        return why
    if placement == "storage":
        return NodePlan(name, node.op_type, scheme, (), weight, None, None, "storage", why)
    macs = node_macs(node, roles, g, elements) if elements is not None else None
    if scheme.mode == "dynamic":
        dynamic = _dynamic_reason(node, weight, scheme)
        if dynamic is None:
            why = f"mode: dynamic ({scheme.rule}); {why}"
            # DynamicQuantizeLinear always makes uint8 activations (asymmetric, per tensor).
            layout = pair_layout(node, roles, g)
            runtime = guard_saturation(
                replace(scheme, activation=replace(scheme.activation, dtype="uint8", symmetric=False)), layout
            )
            return NodePlan(name, node.op_type, runtime, (), weight, None, None, "dynamic", why, macs, layout)
        log.info("%s: %s; quantized statically", name, dynamic)
    output = output_to_quantize(node, g)
    # An int32 bias needs one weight scale per output channel (or one for all): not per block. With fp8
    # the bias stays float, as TensorRT's fp8 layers add it (there is no integer accumulator to match).
    natural = roles.weight.channel_axis if roles.weight else None
    bias_fits = weight is not None and weight.block_size is None and weight.axis in (None, natural)
    bias_fits = bias_fits and not scheme.weight.fp8 and not scheme.activation.fp8
    bias = roles.bias if bias_fits else None
    layout = pair_layout(node, roles, g)
    integer = guard_saturation(scheme, layout)
    return NodePlan(name, node.op_type, integer, roles.activations, weight, bias, output, "integer", why, macs, layout)


def _claim_activations(activations: dict[str, TensorScheme], node: NodePlan, scheme: NodeScheme) -> None:
    """Record the schemes of an integer node's quantized inputs and output; the first reader of a tensor wins."""
    if node.placement != "integer":
        return
    for tensor in (*node.activations, *([node.output] if node.output else [])):
        chosen = activations.setdefault(tensor, scheme.activation)
        if chosen != scheme.activation:
            log.warning(
                "tensor %s: node %s asks for %s, but an earlier reader already set %s (first use wins)",
                tensor,
                node.name,
                scheme.activation.describe() + f" observer={scheme.activation.observer}",
                chosen.describe() + f" observer={chosen.observer}",
            )


def _quantize_residual_inputs(
    model: onnx.ModelProto,
    g: GraphView,
    nodes: list[NodePlan],
    activations: dict[str, TensorScheme],
    scheme: TensorScheme,
) -> None:
    """TensorRT: give both inputs of a residual Add Q/DQ, so the Add fuses into the layer before it.

    A residual Add sums two float activations, one of them the output of a quantized layer;
    without Q/DQ on the other input TensorRT runs the Add (and often the layer) in float.
    """
    quantized_outputs = {n.output for n in nodes if n.output}
    for node in model.graph.node:
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        if any(name in g.initializers or not g.is_float(name) for name in node.input):
            continue
        if not quantized_outputs & set(node.input):
            continue
        for name in node.input:
            activations.setdefault(name, scheme)


def final_weighted_nodes(model: onnx.ModelProto, g: GraphView) -> set[str]:
    """Nodes with a constant weight that reach a graph output through no other such node (final projections)."""
    final: set[str] = set()
    seen: set[str] = set()
    stack = [o.name for o in model.graph.output]
    while stack:
        node = g.producer(stack.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if has_constant_weight(node, g):
            final.add(node.name)
            continue
        stack.extend(name for name in node.input if name)
    return final


def _keeps_final_int8(scheme: NodeScheme) -> bool:
    """Whether a weight-only final projection asked for 4 or 2 bits keeps int8 instead."""
    spec = scheme.weight
    explicit = scheme.rule.startswith("node_name:")  # a rule for this very node is taken at its word
    return bool(spec.final_layer_int8) and not spec.fp16 and quant_type(spec.dtype).bits < 8 and not explicit


def _dynamic_reason(node: onnx.NodeProto, weight: WeightPlan | None, scheme: NodeScheme) -> str | None:
    """Why ``node`` cannot run dynamically quantized (None: it can).

    onnxruntime fuses DynamicQuantizeLinear + MatMulInteger (+ Cast, Mul, bias Add) into one
    DynamicQuantizeMatMul; it has no such fusion for convolutions, whose ConvInteger is slower
    than the static QLinearConv. A MatMul of two activations quantizes both at run time.
    """
    if node.op_type not in ("MatMul", "Gemm"):
        return f"mode: dynamic applies to MatMul and Gemm, not {node.op_type}"
    if weight is None and node.op_type == "MatMul":
        return None  # two activations (attention scores): both quantized at run time
    if weight is None or node.input[1] != weight.name:
        return "mode: dynamic needs a constant weight as the second input"
    if weight.block_size is not None:
        return "mode: dynamic has no per-block weights"
    if scheme.weight.fp8:
        return f"mode: dynamic has no {scheme.weight.dtype} weights (MatMulInteger multiplies integers)"
    if node.op_type == "Gemm":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            return "mode: dynamic needs a Gemm without transA, alpha or beta"
    return None


def passthrough_ops(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, int]:
    """Op type -> number of main-graph nodes qtool has no quantization for and leaves untouched."""
    decided = (
        {n.name for n in plan.nodes} | {name for name, _ in plan.skipped} | {w.owner for w in plan.recurrent_weights}
    )
    untouched = [
        n for n in model.graph.node if n.name not in decided and (n.op_type not in HANDLERS or n.op_type in LOOKUP_OPS)
    ]
    counts = Counter(n.op_type for n in untouched)  # (a Gather of a shape or of computed values is no lookup)
    return dict(sorted(counts.items()))


def _weight_plan(roles: WeightRoles, scheme: NodeScheme, g: GraphView, node: str) -> WeightPlan:
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
    return WeightPlan(roles.name, axis, spec.block_size if spec.per_block else None)
