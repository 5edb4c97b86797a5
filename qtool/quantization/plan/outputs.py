"""The weighted nodes whose quantized output would only be the model's output: left float.

A node's int8 output is clipped to the range calibration saw. Inside the network the next layer's
integer kernel needs it; but where a node's output goes, through reshapes, concatenations and
activations only, to the model's outputs (a detector's box and class heads, a classifier's or a
regressor's last layer), quantizing it buys no integer kernel and costs the output's accuracy twice:
its rounding, and every value past the calibration range clipped (a box coordinate of a held-out image
read 2.94 where fp32 gave 4.62). Such a node keeps its int8 inputs and weight and writes a float output
(a Gemm runs as onnxruntime's QGemm with a float output; a Conv, which has no such kernel on CPU, runs
float on its dequantized weight, as a MatMul may), so it is left float only where its multiply-accumulates
are at most :data:`FLOAT_SHARE` of the model's weighted nodes' (a detector's heads, a classifier's last
layer; not an LLM's vocabulary projection). The main graph's only: a body's outputs are not the model's.
"""

from __future__ import annotations

import onnx

from qtool.graph.index import GraphView, node_subgraphs
from qtool.quantization.plan.roles import HANDLERS, node_macs

FLOAT_SHARE = 0.02  # a Conv / Gemm computes in float only if it does at most this share of the model's work
REASON = "its output stays float: it feeds only the model's outputs (no clipping to the calibration range)"


def float_output_nodes(model: onnx.ModelProto, g: GraphView, final: set[str], elements: dict[str, int]) -> set[str]:
    """The nodes of ``final`` (weighted nodes nearest the outputs) whose output is left float.

    ``elements``: per-sample element counts of tensors (calibration's), which price each node's work.
    """
    macs: dict[str, int] = {}
    for node in model.graph.node:
        handler = HANDLERS.get(node.op_type)
        roles = handler(node, g) if handler is not None and len(node.input) >= 2 else None
        if roles is not None and not isinstance(roles, str) and roles.weight is not None and roles.activations:
            macs[node.name] = node_macs(node, roles, g, elements) or 0
    total = sum(macs.values())
    kept = set()
    for name in sorted(final):
        node = g.by_name.get(name)
        if node is None or node.op_type not in ("Conv", "Gemm", "MatMul") or _reaches_weighted(node, g, macs):
            continue
        if total > 0 and macs.get(name, total) <= FLOAT_SHARE * total:
            kept.add(name)
    return kept


def _reaches_weighted(node: onnx.NodeProto, g: GraphView, weighted: dict[str, int]) -> bool:
    """Whether anything ``node`` computes is read by another weighted node (an FPN level, a shared feature)."""
    seen: set[str] = set()
    stack = [out for out in node.output if out]
    while stack:
        tensor = stack.pop()
        for reader in g.consumers.get(tensor, []):
            if reader.name in weighted or node_subgraphs(reader):  # a body's nodes are not priced: assumed weighted
                return True
            if reader.name not in seen:
                seen.add(reader.name)
                stack.extend(out for out in reader.output if out)
    return False
