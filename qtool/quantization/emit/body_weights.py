"""Weights written stored quantized for nodes that compute in float: body weights and recurrent ops' weights.

A body may read any value of the scopes around it, so each planned weight
(:mod:`qtool.quantization.plan.bodies`) becomes an integer initializer of the main graph and the
Cast/Sub/Mul that restore it there (onnxruntime folds them when the session starts, as for a storage
node); the body's nodes read the restored tensor by its new name. The float weight goes where no node
reads it any more. Nothing else in a body changes: no annotation is added to it. A recurrent op's W and R
(:mod:`qtool.quantization.plan.recurrent`) are stored the same way, and the op itself reads the restored tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import onnx

from qtool.graph.index import GraphView, all_nodes, node_subgraphs
from qtool.graph.weights import Weights
from qtool.numerics.qparams import quantize
from qtool.numerics.ranges import weight_qparams
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.emit.stored_forms import Names, StoredForms
from qtool.quantization.emit.weight_copies import DEQUANTIZED, RESTORED, CopyKey
from qtool.quantization.plan.records import QuantPlan, StoredWeightPlan


def store_outer_weights(
    model: onnx.ModelProto,
    plan: QuantPlan,
    store: Weights,
    restored: Mapping[tuple[str, CopyKey, str], str],
    report: RewriteReport,
) -> None:
    """Store ``plan``'s body and recurrent weights quantized; the report counts them, and the recurrent nodes."""
    report.quantized_weights += store_body_weights(model, plan.stored_weights(), store, restored)
    report.quantized_nodes += list(dict.fromkeys(w.owner for w in plan.recurrent_weights))  # in graph order


def store_body_weights(
    model: onnx.ModelProto,
    plans: tuple[StoredWeightPlan, ...],
    store: Weights,
    restored: Mapping[tuple[str, CopyKey, str], str] | None = None,
) -> list[str]:
    """Store each planned body weight quantized (see the module); returns the weights stored.

    ``restored``: the float tensors the main graph's rewrite restored its stored weights to, by (weight, copy,
    form): a body reads such a tensor instead of a second stored copy of its weight.
    """
    if not plans:
        return []
    main = {w: name for (w, _, form), name in (restored or {}).items() if form in (DEQUANTIZED, RESTORED)}
    graph = model.graph
    names, prologue = Names(graph), list[onnx.NodeProto]()
    forms = StoredForms(names, graph, prologue)
    owners = GraphView(graph).by_name
    stored = []
    for plan in plans:
        init, holder = _initializer(graph, plan.weight)
        if plan.weight in main:
            float_form = main[plan.weight]
        elif init is None or holder is None:
            continue
        else:
            values = store.value(init)
            qp = weight_qparams(values, plan.scheme, plan.axis, f"weight {plan.weight}")
            integers = forms.integers(plan.weight, quantize(values, qp), qp)
            float_form = names.new(f"{plan.weight}/restored")
            forms.restored_at_load(plan.weight, integers, qp, float_form, tuple(values.shape))
            stored.append(plan.weight)
        owner = owners[plan.owner]
        # a Loop's constant state starts from the weight its body reads (see qtool.graph.loop_constants): the owner
        # reads it too, restored alike, so that the float initializer goes
        readers = [owner, *(n for body in node_subgraphs(owner) for n in all_nodes(body))] if plan.body else [owner]
        for node in readers:
            node.input[:] = [float_form if name == plan.weight else name for name in node.input]
        if init is not None and holder is not None and not _read(graph, plan.weight):
            holder.initializer.remove(init)  # the store keeps its values: other builds of the model read them
    nodes = [*prologue, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    return stored


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for body in node_subgraphs(node):
            yield from _graphs(body)


def _initializer(graph: onnx.GraphProto, name: str) -> tuple[onnx.TensorProto | None, onnx.GraphProto | None]:
    """The initializer ``name`` and the graph holding it (the main graph or a body)."""
    for holder in _graphs(graph):
        for init in holder.initializer:
            if init.name == name:
                return init, holder
    return None, None


def _read(graph: onnx.GraphProto, name: str) -> bool:
    """Whether any node (bodies included) or output still reads ``name``."""
    return any(name in node.input for node in all_nodes(graph)) or any(o.name == name for o in graph.output)
