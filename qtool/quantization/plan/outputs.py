"""The integer nodes whose quantized output would only be the model's output: their output is left float.

A node's int8 output is clipped to the range calibration saw. Inside the network the next layer's
integer kernel needs it; but where a node's output goes, through reshapes, concatenations and
activations only, to the model's outputs (a classifier's, a regressor's or an embedding's last layer),
quantizing it buys nothing and costs the output's accuracy twice: its rounding, and every value past
the calibration range clipped. Such a node keeps its int8 inputs and weight and writes a float output
where onnxruntime has an integer kernel that does so, so nothing runs slower:

- a Gemm whose bias is quantized (or that has none) runs as ``QGemm`` with a float output;
- a MatMul read by no Add runs as ``MatMulIntegerToFloat`` (onnxruntime fuses a MatMul and an Add after it
  into a Gemm first, whose float bias no integer kernel takes: that one keeps its quantized output).

A Conv has no integer kernel with a float output on CPU: left float, it would run float on a dequantized input
(a YOLOv8 DFL convolution: 6 % of the model's time for 0.02 dB), so it keeps its quantized output. Only the main
graph's nodes: a body's outputs are not the model's.
"""

from __future__ import annotations

import onnx

from qtool.graph.index import GraphView, node_subgraphs
from qtool.quantization.plan.records import NodePlan
from qtool.quantization.plan.roles import has_constant_weight

REASON = "its output stays float: it feeds only the model's outputs (no clipping to the calibration range)"


def writes_float_output(planned: NodePlan, node: onnx.NodeProto, g: GraphView, final: set[str]) -> bool:
    """Whether the integer node ``planned`` (of ``node``) writes a float output (see the module).

    ``final``: the weighted nodes nearest the model's outputs (no weighted node between them and an output).
    """
    if planned.placement != "integer" or node.name not in final:
        return False
    if node.op_type == "Gemm":
        float_kernel = planned.bias is not None or len(node.input) < 3 or not node.input[2]
    elif node.op_type == "MatMul" and planned.weight is not None and planned.output == node.output[0]:
        float_kernel = not any(reader.op_type == "Add" for reader in g.consumers.get(node.output[0], []))
    else:
        float_kernel = False
    return float_kernel and not _reaches_weighted(node, g)  # the walk last: it is the costly test


def _reaches_weighted(node: onnx.NodeProto, g: GraphView) -> bool:
    """Whether anything ``node`` computes is read by another node with a constant weight, or enters a body.

    Another weighted node: an FPN level, a shared feature, a YOLO head's DFL convolution. A body's nodes are
    not looked into: entering one counts.
    """
    seen: set[str] = set()
    stack = [out for out in node.output if out]
    while stack:
        tensor = stack.pop()
        for reader in g.consumers.get(tensor, []):
            if node_subgraphs(reader) or has_constant_weight(reader, g):
                return True
            if reader.name not in seen:
                seen.add(reader.name)
                stack.extend(out for out in reader.output if out)
    return False
