"""What ``qtool quantize`` would do to a model, node by node, and the size it predicts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from qtool.config import QConfig
from qtool.graph.index import GraphView, node_subgraphs
from qtool.graph.prepare import PrepareReport
from qtool.numerics.qparams import quant_type
from qtool.quantization.plan.kernels import predict_kernels
from qtool.quantization.plan.planner import passthrough_ops
from qtool.quantization.plan.records import NodePlan, QuantPlan
from qtool.quantization.plan.recurrent import recurrent_reason
from qtool.schemas.reports.inspect import InspectedNode

_FLOAT_BYTES = 4


@dataclass(frozen=True)
class Inspection:
    """Per-node decisions, what stays float and why, and the predicted on-disk size."""

    model_path: str
    model_bytes: int
    rows: list[InspectedNode]
    kept_float: list[tuple[str, str, str]]  # (node, op type, reason)
    passthrough: dict[str, int] = field(default_factory=dict)  # op type -> count of untouched nodes
    rewritten_bytes: int | None = None  # size of the rewritten graph (exact up to scale values)
    placement_note: str = ""  # how quantize decides the placement shown (measured, or kept storage-only)
    prepare: PrepareReport | None = None  # what graph preparation changed before the plan (as quantize reports it)

    @property
    def predicted_bytes(self) -> int:
        if self.rewritten_bytes is not None:
            return self.rewritten_bytes
        saved = sum(r.float_bytes - r.quantized_bytes for r in self.rows)
        return max(1, self.model_bytes - saved)

    @property
    def predicted_ratio(self) -> float:
        return self.model_bytes / self.predicted_bytes


def _stored_bytes(elements: int, groups: int, dtype: str) -> int:
    """Bytes of a weight stored as ``dtype`` with ``groups`` scales (and zero points)."""
    if dtype == "fp16":
        return elements * 2
    bits = quant_type(dtype).bits
    return math.ceil(elements * bits / 8) + groups * _FLOAT_BYTES + math.ceil(groups * bits / 8)


def _groups(shape: list[int], plan: NodePlan) -> int:
    weight = plan.weight
    if weight is None or weight.axis is None:
        return 1
    if weight.block_size is None:
        return shape[weight.axis]
    blocks = math.ceil(shape[weight.axis] / weight.block_size)
    return int(np.prod(shape)) // shape[weight.axis] * blocks


def inspect_plan(
    model_path: str, model_bytes: int, prepared: onnx.ModelProto, plan: QuantPlan, config: QConfig
) -> Inspection:
    """Build the inspection of a prepared model and its plan."""
    counted: set[tuple[str, str]] = set()
    rows = _node_rows(prepared, plan, counted, "")
    rows += _body_rows(prepared, plan, counted)
    nodes = GraphView(prepared).by_name
    kept = []
    for name, reason in plan.skipped:
        op_type = nodes[name].op_type if name in nodes else ""
        _, rule = config.resolve(name, op_type)
        kept.append((name, op_type or "?", f"{reason} ({rule})" if "config" in reason else reason))
    return Inspection(model_path, model_bytes, rows, kept, passthrough_ops(prepared, plan))


def _node_rows(
    model: onnx.ModelProto, plan: QuantPlan, counted: set[tuple[str, str]], where: str
) -> list[InspectedNode]:
    """One row per planned node, then those of each If branch (planned as a model; ``where`` names the branch)."""
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    kernels = predict_kernels(model, plan)
    rows = []
    for node in plan.nodes:
        weight_text, elements, float_bytes, stored = "-", 0, 0, 0
        if node.weight is not None:
            shape = shapes[node.weight.name]
            elements = int(np.prod(shape))
            spec = node.scheme.weight
            weight_text = spec.describe()
            key = (node.weight.name, weight_text)
            if key not in counted:  # a weight shared by several nodes is stored once
                counted.add(key)
                float_bytes = elements * _FLOAT_BYTES
                stored = _stored_bytes(elements, _groups(shape, node), spec.dtype)
        activation = node.scheme.activation.describe() if node.activations else "float"
        if node.placement == "dynamic":
            activation = "uint8 per_tensor asym, at run time"
        kernel = kernels[node.name]
        predicted = f"{kernel.kernel} (in {where})" if where else kernel.kernel
        rows.append(
            InspectedNode(
                name=node.name,
                op_type=node.op_type,
                rule=node.scheme.rule,
                weight=weight_text,
                activation=activation,
                weight_elements=elements,
                float_bytes=float_bytes,
                quantized_bytes=stored,
                placement=node.kind,
                placement_reason=f"{node.reason} ({where})" if where else node.reason,
                predicted_kernel=predicted,
                integer_kernel=not predicted.startswith("float"),
                kernel_reason=kernel.reason,
                algorithms=[] if node.chained else list(node.scheme.algorithms.names()),  # weight algorithms: no weight
                weight_form="",  # the rewrite's (qtool.pipeline.inspect)
            )
        )
    for branch in plan.branches:
        rows += _node_rows(branch.model, branch.plan, counted, f"{where + ' > ' if where else ''}{branch.branch.label}")
    return rows


def _body_rows(prepared: onnx.ModelProto, plan: QuantPlan, counted: set[tuple[str, str]]) -> list[InspectedNode]:
    """One row per weight stored for a node that computes in float: in an If/Loop/Scan body, or a recurrent op's."""
    shapes = {init.name: list(init.dims) for graph in _graphs(prepared.graph) for init in graph.initializer}
    recurrent = [w for p in (plan, *(b.plan for b in plan.every_branch())) for w in p.recurrent_weights]
    rows = []
    for body in (*plan.body_weights, *recurrent):
        shape = shapes.get(body.weight, [])
        elements = int(np.prod(shape)) if shape else 0
        key = (body.weight, body.scheme.describe())
        fresh = key not in counted
        counted.add(key)
        groups = shape[body.axis] if body.axis is not None and shape else 1
        if body.body:
            name = body.node or f"({body.op_type} in {body.owner})"
            why = f"inside {body.owner}'s {body.body}: activations stay float (not observed there)"
            kernel = f"float {body.op_type} (in {body.owner}.{body.body})"
        else:
            name, why, kernel = f"{body.node} ({body.weight})", recurrent_reason(body), f"float {body.op_type}"
        row = InspectedNode(
            name=name,
            op_type=body.op_type,
            rule=body.rule,
            weight=body.scheme.describe(),
            activation="float",
            weight_elements=elements,
            float_bytes=elements * _FLOAT_BYTES if fresh else 0,
            quantized_bytes=_stored_bytes(elements, groups, body.scheme.dtype) if fresh else 0,
            placement="storage",
            placement_reason=why,
            predicted_kernel=kernel,
            integer_kernel=False,  # computes in float
            kernel_reason="",
            algorithms=[],
            weight_form="",
        )
        rows.append(row)
    return rows


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``graph`` and every body in it, depth first."""
    return [graph, *(g for node in graph.node for sub in node_subgraphs(node) for g in _graphs(sub))]
