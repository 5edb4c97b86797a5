"""Integer chains: the unweighted ops between integer kernels that onnxruntime also runs on 8-bit values.

Without them, every SiLU (``x * Sigmoid(x)``), residual Add and Concat between two integer
convolutions goes back to float: a DequantizeLinear before it, a QuantizeLinear after. With
Q/DQ around them too, onnxruntime's CPU provider fuses each group into an integer kernel
(:data:`FUSED_KERNELS`) or drops the pair around an op that only moves values
(:data:`PASS_THROUGH`), and the chain stays 8-bit from one weighted node to the next.

Only the *interior* of the integer region is chained: an op is quantized when one of its
data inputs comes from an integer node (or from a chained op) and its output reaches an
integer node's input (directly or through chained ops). What follows the last weighted node
(a detector's box decoding, a classifier's final Softmax) stays float, where rounding would
cost the most accuracy for the least time. A pass-through op's outputs take its input's
scale and zero point, which onnxruntime requires to drop the pair.
"""

from __future__ import annotations

import onnx

from qtool.config import QConfig
from qtool.graph.index import GraphView
from qtool.quantization.plan.records import NodePlan
from qtool.quantization.plan.roles import CHAIN_OPS, FUSED_KERNELS, PASS_THROUGH, folds_into_quantizer
from qtool.schemes import NodeScheme

_ALL_INPUTS = frozenset({"Add", "Mul", "Concat"})  # every input carries data; the others read data at input 0
_EIGHT_BIT = ("int8", "uint8")


def data_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of a chain op that carry values (not shapes, axes, scales or ROIs)."""
    if node.op_type in _ALL_INPUTS:
        return [name for name in node.input if name]
    return [node.input[0]] if node.input and node.input[0] else []


def chain_scheme(node: onnx.NodeProto, config: QConfig) -> NodeScheme | None:
    """The scheme a chain op's tensors get, or None when the config keeps it float.

    Only 8-bit integer activations have integer kernels for these ops; a node the config (or
    the sensitivity search) keeps float, places as storage or quantizes dynamically is left alone.
    """
    scheme = config.scheme_for(node.name, node.op_type)
    if scheme is None or scheme.weight_only or scheme.mode == "dynamic":
        return None
    if scheme.placement not in ("auto", "integer") or scheme.activation.dtype not in _EIGHT_BIT:
        return None
    if scheme.placement == "auto" and not config.chains:  # the placement choice's "unchained" candidate
        return None
    return scheme


def _chainable(node: onnx.NodeProto, g: GraphView) -> bool:
    """Whether onnxruntime has an 8-bit kernel for this instance of a chain op (all data inputs run-time floats)."""
    if node.op_type not in CHAIN_OPS or node.domain not in ("", "ai.onnx"):
        return False
    inputs = data_inputs(node)
    if not inputs or any(name in g.initializers or not g.is_float(name) for name in inputs):
        return False  # a constant operand would need its own quantized copy: the op stays float
    outputs = [name for name in node.output if name]
    if node.op_type == "MaxPool" and len(outputs) > 1:
        return False  # the indices output has no integer kernel
    if node.op_type == "Split" and len(outputs) != len(node.output):
        return False
    return all(g.is_float(name) for name in outputs)


def _quantized_output(node: onnx.NodeProto, g: GraphView) -> str | None:
    """The tensor quantized after a computing chain op: past a Relu or ReLU6 it alone feeds (onnxruntime folds it)."""
    if node.op_type in PASS_THROUGH or len(node.output) != 1:
        return node.output[0] if len(node.output) == 1 else None
    out = node.output[0]
    users = g.consumers.get(out, [])
    if out not in g.graph_outputs and len(users) == 1 and folds_into_quantizer(users[0], g):
        return users[0].output[0]
    return out


def plan_chains(g: GraphView, config: QConfig, integer: list[NodePlan]) -> tuple[list[NodePlan], dict[str, str]]:
    """The chain ops to quantize between ``integer`` nodes, and the tensors that share another's qparams.

    Returns:
        One integer :class:`NodePlan` per chained op (no weight), in graph order, and a map from
        each pass-through op's output to the input whose scale and zero point it reuses.
    """
    quantized = {t for n in integer for t in (*n.activations, *([n.output] if n.output else []))}
    candidates = {}
    for node in g.nodes:
        scheme = chain_scheme(node, config) if _chainable(node, g) else None
        if scheme is not None:
            candidates[node.name] = (node, scheme)
    # forward: a data input is quantized already or written by a chained op
    forward: set[str] = set()
    written = set(quantized)
    changed = True
    while changed:
        changed = False
        for name, (node, _) in candidates.items():
            if name not in forward and any(t in written for t in data_inputs(node)):
                forward.add(name)
                written.update(_outputs(node, g))
                changed = True
    # backward: an output (past a folded Relu or ReLU6) is read by an integer node or by a chained op
    backward: set[str] = set()
    needed = {t for n in integer for t in n.activations}
    changed = True
    while changed:
        changed = False
        for name in forward - backward:
            node = candidates[name][0]
            if any(t in needed for t in _outputs(node, g)):
                backward.add(name)
                needed.update(data_inputs(node))
                changed = True
    plans, shared = [], {}
    for node in g.nodes:
        if node.name not in backward:
            continue
        scheme = candidates[node.name][1]
        output = _quantized_output(node, g)
        why = f"chained between integer kernels ({FUSED_KERNELS.get(node.op_type, 'int8 ' + node.op_type)})"
        inputs = tuple(data_inputs(node))
        plans.append(NodePlan(node.name, node.op_type, scheme, inputs, None, None, output, "integer", why))
        if node.op_type in PASS_THROUGH:
            for out in node.output:
                shared[out] = node.input[0]
    return plans, shared


def _outputs(node: onnx.NodeProto, g: GraphView) -> list[str]:
    """What a chain op writes, the output of a Relu or ReLU6 it alone feeds included."""
    folded = _quantized_output(node, g)
    return [*(name for name in node.output if name), *([folded] if folded and folded not in node.output else [])]
