"""Bodies written quantized: each If branch's or Loop/Scan body's model rewritten by its plan, put back in place.

The body model's rewritten nodes and initializers (its integer weights, scales and zero points) replace the
body's; its inputs and outputs keep their names, and no shape annotation is added to it. The constants only
that body read leave the main graph (see :mod:`qtool.graph.branches`; the plan lists them). Weights are
stored inside the body, embedded: onnxruntime fuses a body's Q/DQ into integer kernels only around its own
initializers.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from qtool.graph.branches import branch_graph, defined_names
from qtool.graph.index import node_subgraphs
from qtool.graph.weights import Weights, is_detached, numpy_dtype
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.plan.records import QuantPlan

Rewrite = Callable[[onnx.ModelProto, QuantPlan], tuple[onnx.ModelProto, RewriteReport]]


def write_branches(
    rewritten: onnx.ModelProto, source: onnx.ModelProto, plan: QuantPlan, rewrite: Rewrite, store: Weights
) -> RewriteReport:
    """Rewrite each planned body of ``source`` into ``rewritten`` (in place); what the bodies' rewrites did."""
    report = RewriteReport()
    if not plan.branches:
        return report
    moved = {name for planned in plan.branches for name in planned.owned}
    kept = [i for i in rewritten.graph.initializer if i.name not in moved]
    del rewritten.graph.initializer[:]
    rewritten.graph.initializer.extend(kept)
    for planned in plan.branches:
        sub, sub_report = rewrite(planned.model, planned.plan)
        body = branch_graph(rewritten, planned.branch)
        _replace_body(body, sub.graph, store)
        _unclash(body, defined_names(rewritten.graph, skip=(planned.branch.owner, planned.branch.attribute)))
        for opset in sub.opset_import:
            if all(o.domain != opset.domain for o in rewritten.opset_import):
                rewritten.opset_import.append(opset)
        report.merge(sub_report)
    return report


def _replace_body(body: onnx.GraphProto, written: onnx.GraphProto, store: Weights) -> None:
    """Put a body model's rewritten graph in place of ``body``: its nodes and constants, embedded."""
    del body.node[:]
    body.node.extend(written.node)
    del body.initializer[:]
    for tensor in written.initializer:
        copy = body.initializer.add()
        copy.CopyFrom(tensor)
        if is_detached(copy):
            copy.ClearField("external_data")
            copy.ClearField("data_location")
            copy.raw_data = store.arrays[copy.name].astype(numpy_dtype(copy), copy=False).tobytes()
    del body.value_info[:]


def _unclash(body: onnx.GraphProto, outside: set[str]) -> None:
    """Rename what the body defines under a name defined outside it (a Q/DQ name the main graph has too)."""
    inside = defined_names(body)
    clashes = sorted(inside & outside)
    if not clashes:
        return
    renamed, taken = {}, outside | inside
    for name in clashes:
        new, count = f"{name}/{body.name}", 1
        while new in taken:
            count += 1
            new = f"{name}/{body.name}{count}"
        renamed[name] = new
        taken.add(new)
    _rename(body, renamed)


def _rename(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Apply ``renamed`` to every definition and reference in ``graph``, nested bodies included."""
    for tensor in graph.initializer:
        tensor.name = renamed.get(tensor.name, tensor.name)
    for value in graph.output:
        value.name = renamed.get(value.name, value.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = renamed.get(name, name)
        for sub in node_subgraphs(node):
            _rename(sub, renamed)
