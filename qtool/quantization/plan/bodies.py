"""Weights read inside bodies that stay outside them: stored quantized in the main graph, and how.

If branches and Loop/Scan bodies are planned as models of their own (:mod:`qtool.quantization.plan.branches`);
a constant weight one of them shares with a main-graph node or another body stays an outer value there. Such a
weight (and any body weight of an unnamed owner) is stored quantized like a storage-placed node's and
restored at load, outside the body (:mod:`qtool.quantization.emit.body_weights`); the node in the body
computes in float on it. The config's rules decide each reading node's weight dtype and granularity as
anywhere else (``node_name`` rules name nodes inside bodies too).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import onnx
from onnx import TensorProto, helper

from qtool.config import QConfig
from qtool.graph.index import GraphView, node_subgraphs
from qtool.quantization.plan.records import STORED_DTYPES, StoredWeightPlan
from qtool.quantization.plan.recurrent import GATE_ROWS, RECURRENT_OPS, RECURRENT_WEIGHT_INPUTS
from qtool.quantization.plan.roles import LOOKUP_MIN_VALUES, LOOKUP_OPS

WEIGHT_INPUT = {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1}  # which input holds the weight


def plan_body_weights(g: GraphView, config: QConfig) -> tuple[StoredWeightPlan, ...]:
    """The body weights ``config`` quantizes, each weight once (its first reader's scheme)."""
    plans: dict[str, StoredWeightPlan] = {}
    for owner in g.nodes:
        for plan in owner_body_weights(owner, g.every_initializer, config):
            plans.setdefault(plan.weight, plan)
    return tuple(plans.values())


def owner_body_weights(
    owner: onnx.NodeProto, constants: Mapping[str, TensorProto], config: QConfig
) -> list[StoredWeightPlan]:
    """The weights read inside ``owner``'s bodies (at any depth) that ``config`` quantizes."""
    plans = []
    for where, body, scope in _bodies(owner, constants, ""):
        for node in body.node:
            plans += _weight_plans(owner.name, where, node, scope, config)
    return plans


def bodies_note(owner: onnx.NodeProto, constants: Mapping[str, TensorProto], config: QConfig) -> str:
    """What happens inside ``owner``'s bodies, for the plan's list of nodes kept float."""
    count = sum(len(body.node) for _, body, _ in _bodies(owner, {}, ""))
    stored = {plan.weight: plan.scheme.dtype for plan in owner_body_weights(owner, constants, config)}
    where = f"{owner.op_type} {'bodies' if len(node_subgraphs(owner)) > 1 else 'body'}"
    nodes = f"{count} node{'' if count == 1 else 's'} inside its {where}"
    if not stored:
        return f"{nodes} left float (no weight there that the config quantizes)"
    dtypes = "/".join(sorted(set(stored.values())))
    return (
        f"{nodes} compute in float (calibration does not observe a loop's iterations); their {len(stored)} "
        f"weight{'' if len(stored) == 1 else 's'} stored {dtypes}, restored at load"
    )


def body_node_counts(graph: onnx.GraphProto) -> dict[str, dict[str, int]]:
    """Nodes per body of each main-graph node that has bodies: owner -> body -> node count (nested counted)."""
    counts: dict[str, dict[str, int]] = {}
    for owner in graph.node:
        for where, body, _ in _bodies(owner, {}, ""):
            counts.setdefault(owner.name, {})[where] = len(body.node)
    return counts


def _bodies(
    node: onnx.NodeProto, scope: Mapping[str, TensorProto], prefix: str
) -> Iterator[tuple[str, onnx.GraphProto, dict[str, TensorProto]]]:
    """Each body of ``node`` at any depth, with the constants it can read (its own and the outer scopes')."""
    for attribute in node.attribute:
        graphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for index, body in enumerate(graphs):
            name = attribute.name if len(graphs) == 1 else f"{attribute.name}[{index}]"
            where = f"{prefix}{name}"
            inner = {**scope, **{init.name: init for init in body.initializer}}
            yield where, body, inner
            for child in body.node:
                yield from _bodies(child, inner, f"{where}/{child.name or child.op_type}/")


def _weight_plans(
    owner: str, where: str, node: onnx.NodeProto, scope: Mapping[str, TensorProto], config: QConfig
) -> list[StoredWeightPlan]:
    """The weights of one node in a body that ``config`` stores: W and R, a row lookup's table, one weight.

    A row lookup's table is a merged decoder's embedding, which both its branches read.
    """
    if node.domain not in ("", "ai.onnx"):
        return []
    recurrent = node.op_type in RECURRENT_OPS
    indices = RECURRENT_WEIGHT_INPUTS if recurrent else (WEIGHT_INPUT.get(node.op_type, len(node.input)),)
    if node.op_type in LOOKUP_OPS and _row_lookup(node, scope):
        indices = (0,)
    found = (scope.get(node.input[i]) for i in indices if i < len(node.input))
    weights = [w for w in found if w is not None and w.data_type == TensorProto.FLOAT and len(w.dims) >= 2]
    if not weights:
        return []
    scheme, rule = config.resolve(node.name, node.op_type)
    if scheme is None or scheme.weight.dtype not in STORED_DTYPES:
        return []
    tensor, plans = scheme.weight, []
    for weight in weights:
        axis: int | None = GATE_ROWS if recurrent else _channel_axis(node, len(weight.dims))
        axis = None if tensor.granularity == "per_tensor" else axis
        plans.append(StoredWeightPlan(owner, where, node.name, node.op_type, weight.name, tensor, axis, rule))
    return plans


def _row_lookup(node: onnx.NodeProto, scope: Mapping[str, TensorProto]) -> bool:
    """Whether a Gather picks rows (axis 0) of a constant table large enough to store quantized (as in the graph)."""
    table = scope.get(node.input[0]) if node.input else None
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    return table is not None and axis == 0 and math.prod(table.dims) >= LOOKUP_MIN_VALUES


def _channel_axis(node: onnx.NodeProto, rank: int) -> int:
    """The output-channel axis of the weight (a table's rows; per-block rules get per-channel scales in bodies)."""
    if node.op_type in LOOKUP_OPS or node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return rank - 1  # MatMul: [..., K, N]
