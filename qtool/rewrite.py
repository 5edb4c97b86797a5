"""Plan + qparams -> a new graph with QuantizeLinear / DequantizeLinear nodes.

Naming keeps the float tensor names a user sees: a quantized activation ``T``
produced by a node is renamed ``T/float`` at its producer, and the
DequantizeLinear that follows writes ``T`` again, so every consumer (and a graph
output) reads the dequantized value under the original name. Weights become
integer initializers ``W/quantized`` whose DequantizeLinear writes ``W``. One
Q/DQ pair exists per tensor, shared by all its consumers. Every generated name
is derived from tensor names, so the same inputs give the same graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.config import TensorScheme
from qtool.errors import QtoolError
from qtool.plan import NodePlan, QuantPlan
from qtool.qparams import QParams, compute_qparams, quant_type, quantize, quantize_bias, weight_range


@dataclass
class RewriteReport:
    """What :func:`insert_qdq` changed."""

    quantized_nodes: list[str] = field(default_factory=list)
    quantized_weights: list[str] = field(default_factory=list)
    quantized_biases: list[str] = field(default_factory=list)
    quantized_activations: list[str] = field(default_factory=list)


class _Names:
    """Hands out tensor/node names that do not clash with the graph's."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.taken = {i.name for i in graph.initializer} | {i.name for i in graph.input}
        for node in graph.node:
            self.taken.update(node.output)
            self.taken.add(node.name)

    def new(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


def weight_qparams(weight: np.ndarray, scheme: TensorScheme, axis: int | None, what: str) -> QParams:
    """Scale / zero point of a weight from its own values (symmetric weights use the narrow range)."""
    lo, hi = weight_range(weight, axis)
    return compute_qparams(
        lo,
        hi,
        quant_type(scheme.dtype),
        symmetric=scheme.symmetric,
        narrow_range=scheme.symmetric,
        axis=axis,
        what=what,
    )


def activation_qparams(rmin: np.ndarray, rmax: np.ndarray, scheme: TensorScheme, what: str) -> QParams:
    """Scale / zero point of an activation from its observed range."""
    return compute_qparams(rmin, rmax, quant_type(scheme.dtype), symmetric=scheme.symmetric, what=what)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, plan: QuantPlan, act_qparams: dict[str, QParams]) -> None:
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.graph = self.model.graph
        self.plan = plan
        self.act_qparams = act_qparams
        self.names = _Names(self.graph)
        self.inits = {i.name: i for i in self.graph.initializer}
        self.graph_inputs = {i.name for i in self.graph.input}
        self.prologue: list[onnx.NodeProto] = []  # DQ of weights, Q/DQ of graph inputs
        self.after: dict[str, list[onnx.NodeProto]] = {}  # tensor -> Q/DQ to emit after its producer
        self.renamed_inputs: dict[tuple[str, str], str] = {}  # (node, tensor) -> new input name
        self.renamed_outputs: dict[str, str] = {}  # producer output renames
        self.removed_inits: set[str] = set()
        self.weight_done: dict[str, QParams] = {}
        self.report = RewriteReport()
        self.use_count: dict[str, int] = {}
        for node in self.graph.node:
            for name in node.input:
                self.use_count[name] = self.use_count.get(name, 0) + 1

    # -- helpers ------------------------------------------------------------
    def _add_qparam_inits(self, base: str, qp: QParams) -> tuple[str, str]:
        scale = self.names.new(f"{base}/scale")
        zero = self.names.new(f"{base}/zero_point")
        self.graph.initializer.append(numpy_helper.from_array(qp.scale.astype(np.float32), scale))
        self.graph.initializer.append(numpy_helper.from_array(qp.zero_point, zero))
        return scale, zero

    def _dq_node(self, base: str, source: str, scale: str, zero: str, output: str, axis: int | None) -> onnx.NodeProto:
        node = helper.make_node(
            "DequantizeLinear", [source, scale, zero], [output], name=self.names.new(f"{base}/DequantizeLinear")
        )
        if axis is not None:
            node.attribute.append(helper.make_attribute("axis", axis))
        return node

    def _replace_constant(self, name: str, values: np.ndarray, qp: QParams, output: str) -> None:
        """Store ``values`` as integers and make a DequantizeLinear write ``output``."""
        stored = self.names.new(f"{name}/quantized")
        self.graph.initializer.append(numpy_helper.from_array(values, stored))
        scale, zero = self._add_qparam_inits(name, qp)
        self.prologue.append(self._dq_node(name, stored, scale, zero, output, qp.axis))

    # -- roles --------------------------------------------------------------
    def quantize_activation(self, tensor: str) -> None:
        qp = self.act_qparams[tensor]
        scale, zero = self._add_qparam_inits(tensor, qp)
        quantized = self.names.new(f"{tensor}/quantized")
        if tensor in self.graph_inputs:
            source, output = tensor, self.names.new(f"{tensor}/dequantized")
            for node in self.graph.node:
                for i, name in enumerate(node.input):
                    if name == tensor:
                        node.input[i] = output
            target = self.prologue
        else:
            source, output = self.names.new(f"{tensor}/float"), tensor
            self.renamed_outputs[tensor] = source
            target = self.after.setdefault(tensor, [])
        target.append(
            helper.make_node(
                "QuantizeLinear", [source, scale, zero], [quantized], name=self.names.new(f"{tensor}/QuantizeLinear")
            )
        )
        target.append(self._dq_node(tensor, quantized, scale, zero, output, None))
        self.report.quantized_activations.append(tensor)

    def quantize_weight(self, node: NodePlan) -> QParams:
        assert node.weight is not None  # callers check; plans only list weights they own
        name = node.weight.name
        if name in self.weight_done:
            return self.weight_done[name]
        values = numpy_helper.to_array(self.inits[name])
        qp = weight_qparams(values, node.scheme.weight, node.weight.axis, what=f"weight {name}")
        self._replace_constant(name, quantize(values, qp), qp, name)
        self.removed_inits.add(name)
        self.weight_done[name] = qp
        self.report.quantized_weights.append(name)
        return qp

    def quantize_bias(self, node: NodePlan, onnx_node: onnx.NodeProto, weight_qp: QParams) -> None:
        assert node.bias is not None
        input_qp = self.act_qparams[node.activations[0]]
        values = numpy_helper.to_array(self.inits[node.bias])
        q, qp = quantize_bias(values, input_qp.scale, weight_qp.scale)
        if self.use_count.get(node.bias, 0) == 1:
            output = node.bias
            self.removed_inits.add(node.bias)
        else:  # a shared bias: each node gets its own int32 copy under its own name
            output = self.names.new(f"{node.bias}/{node.name}")
            self.renamed_inputs[(node.name, node.bias)] = output
        self._replace_constant(output, q, qp, output)
        self.report.quantized_biases.append(node.bias)

    # -- driver -------------------------------------------------------------
    def run(self) -> tuple[onnx.ModelProto, RewriteReport]:
        by_name = {n.name: n for n in self.graph.node}
        for tensor in self.plan.activations:
            self.quantize_activation(tensor)
        for plan_node in self.plan.nodes:
            onnx_node = by_name[plan_node.name]
            if plan_node.weight is not None:
                weight_qp = self.quantize_weight(plan_node)
                if plan_node.bias is not None and plan_node.activations:
                    self.quantize_bias(plan_node, onnx_node, weight_qp)
            self.report.quantized_nodes.append(plan_node.name)
        self._assemble()
        return self.model, self.report

    def _assemble(self) -> None:
        nodes: list[onnx.NodeProto] = list(self.prologue)
        for node in self.graph.node:
            for (owner, old), new in self.renamed_inputs.items():
                if owner == node.name:
                    for i, name in enumerate(node.input):
                        if name == old:
                            node.input[i] = new
            produced = list(node.output)
            for i, name in enumerate(produced):
                if name in self.renamed_outputs:
                    node.output[i] = self.renamed_outputs[name]
            nodes.append(node)
            for name in produced:
                nodes.extend(self.after.get(name, []))
        kept_inits = [i for i in self.graph.initializer if i.name not in self.removed_inits]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept_inits)
        # Shape information of renamed tensors is stale; onnxruntime re-infers it.
        del self.graph.value_info[:]


def insert_qdq(
    model: onnx.ModelProto, plan: QuantPlan, act_qparams: dict[str, QParams]
) -> tuple[onnx.ModelProto, RewriteReport]:
    """Return a copy of ``model`` with Q/DQ nodes and integer weights as ``plan`` says.

    Args:
        model: the prepared float model the plan was built from.
        plan: what to quantize.
        act_qparams: scale / zero point of every tensor in ``plan.activations``.

    Raises:
        QtoolError: an activation in the plan has no qparams.
    """
    missing = [t for t in plan.activations if t not in act_qparams]
    if missing:
        raise QtoolError(
            f"no statistics for tensor '{missing[0]}' ({len(missing)} tensors missing)",
            hint="re-run qtool calibrate with the same model and config",
        )
    return _Rewriter(model, plan, act_qparams).run()


def check_quantized_model(model: onnx.ModelProto) -> None:
    """Run onnx's full checker; a failure here is a qtool bug, not a user error."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise RuntimeError(f"qtool produced a model that fails onnx.checker: {e}") from e
