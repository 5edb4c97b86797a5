"""Placement: integer kernel or storage-only, per node, from the work it does and its neighbours."""

from __future__ import annotations

from typing import Literal

import onnx

from qtool.graph.index import GraphView
from qtool.quantization.plan.records import QuantPlan
from qtool.quantization.plan.roles import Roles, is_depthwise, node_macs
from qtool.schemes import NodeScheme, RulePlacement

Decision = RulePlacement | Literal["float"]  # what the rules make of one node ("float": not quantized)

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


def node_placement(
    node: onnx.NodeProto, roles: Roles, scheme: NodeScheme, g: GraphView, elements: dict[str, int] | None
) -> tuple[Decision, str]:
    """(what the node becomes, why) for one node."""
    if scheme.placement == "integer":
        return "integer", f"placement: integer ({scheme.rule})"
    if scheme.placement == "storage":
        if roles.weight is None:  # a product of two activations (or a weight computed at run time): nothing to store
            return "float", f"placement: storage ({scheme.rule}), but no constant weight to store: kept float"
        return "storage", f"placement: storage ({scheme.rule})"
    if elements is None:
        return "integer", "auto without tensor sizes (decided when quantizing with data)"
    if is_depthwise(node, roles, g):
        return "storage", "auto: depthwise convolution does too little work per value for int8 kernels"
    if node.op_type == "ConvTranspose":
        return "storage", "auto: onnxruntime (CPU) has no integer ConvTranspose kernel"
    macs = node_macs(node, roles, g, elements)
    if macs is None:
        return "integer", "auto: size unknown, integer kernel assumed"
    if macs < AUTO_MIN_MACS:
        small = f"{macs:,} MACs per sample < {AUTO_MIN_MACS:,}, Q/DQ would cost more than int8 saves"
        # without a constant weight there is nothing to store: the node simply stays float
        return ("storage", f"auto: {small}") if roles.weight is not None else ("float", f"auto: kept float, {small}")
    return "integer", f"auto: {macs:,} MACs per sample"


# Ops onnxruntime runs on the quantized values between integer kernels (or that only move data):
# a tensor that reaches an integer node through them crosses no float/integer boundary.
_TRANSPARENT = {"MaxPool", "Relu", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"}


def isolated_integer_nodes(plan: QuantPlan, g: GraphView, elements: dict[str, int]) -> dict[str, str]:
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
