"""The branches of a main graph's If nodes, each as a model of its own that the whole pipeline can quantize.

A branch reads the scopes around it. As a model, the outer values it reads become its inputs (typed
from the main graph) and the outer constants only it reads become its own initializers, so a branch
quantized with integer kernels holds its integer weights beside its Q/DQ nodes, where onnxruntime
fuses them (it does not fuse a weight dequantized in the outer scope). A constant another node or body
reads as well stays outer (an input of the branch's model): it is stored once, in the main graph.
Nested If nodes are the branch model's own branches, in turn. Loop and Scan bodies are not branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

from qtool.graph.index import GraphView, all_nodes, node_subgraphs

BRANCH_ATTRIBUTES = ("then_branch", "else_branch")


@dataclass(frozen=True)
class Branch:
    """One branch of one If node of a main graph."""

    owner: str  # the If node's name
    attribute: str  # then_branch or else_branch

    @property
    def label(self) -> str:
        return f"{self.owner}'s {self.attribute}"


def if_branches(model: onnx.ModelProto) -> list[Branch]:
    """Every branch of every If node of ``model``'s main graph, in graph order (named nodes only)."""
    return [
        Branch(node.name, attr.name)
        for node in model.graph.node
        if node.op_type == "If" and node.name
        for attr in node.attribute
        if attr.name in BRANCH_ATTRIBUTES and attr.HasField("g")
    ]


def branch_graph(model: onnx.ModelProto, branch: Branch) -> onnx.GraphProto:
    """The branch's graph inside ``model``."""
    owner = GraphView(model).by_name[branch.owner]
    return next(a.g for a in owner.attribute if a.name == branch.attribute)


def branch_model(model: onnx.ModelProto, branch: Branch, view: GraphView | None = None) -> onnx.ModelProto:
    """The branch as a model (see the module): outer values as inputs, the constants only it reads as its own."""
    g = view if view is not None else GraphView(model)
    body = branch_graph(model, branch)
    local = _local_names(body)
    outer = sorted(
        {name for node in all_nodes(body) for name in node.input if name and name not in local},
        key=lambda n: (n not in g.initializers, n),
    )
    owned = set(owned_constants(model, branch, g))
    initializers = [*body.initializer, *(g.initializers[name] for name in outer if name in owned)]
    inputs = [_typed(g, name) for name in outer if name not in owned]
    graph = helper.make_graph(
        list(body.node),
        body.name or branch.attribute,
        inputs,
        list(body.output),
        initializers,
        value_info=body.value_info,
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name=model.producer_name)
    sub.ir_version = model.ir_version
    try:  # the planner reads each tensor's type: a body carries few annotations
        inferred = onnx.shape_inference.infer_shapes(sub)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return sub
    del sub.graph.value_info[:]
    sub.graph.value_info.extend(inferred.graph.value_info)
    return sub


def owned_constants(model: onnx.ModelProto, branch: Branch, view: GraphView | None = None) -> list[str]:
    """The main graph's constants that this branch reads and nothing else does (no node, no other body)."""
    g = view if view is not None else GraphView(model)
    body = branch_graph(model, branch)
    read_here = {name for node in all_nodes(body) for name in node.input if name in g.initializers}
    elsewhere: set[str] = set(g.graph_outputs)
    for node in g.nodes:
        elsewhere.update(name for name in node.input if name)
        for attr in node.attribute:
            if node.name == branch.owner and attr.name == branch.attribute:
                continue
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                elsewhere.update(name for inner in all_nodes(sub) for name in inner.input if name)
    return sorted(read_here - elsewhere)


def _local_names(body: onnx.GraphProto) -> set[str]:
    """Every name defined inside ``body`` at any depth: its inputs, initializers and node outputs."""
    names = {i.name for i in body.input} | {i.name for i in body.initializer}
    for node in body.node:
        names.update(node.output)
        for sub in node_subgraphs(node):
            names |= _local_names(sub)
    return names


def _typed(g: GraphView, name: str) -> onnx.ValueInfoProto:
    """An outer value as an input of a branch's model, with the main graph's element type and shape."""
    elem = g.elem_types.get(name, onnx.TensorProto.FLOAT)
    shape = g.shapes.get(name)
    return helper.make_tensor_value_info(name, elem, shape)


def expose(model: onnx.ModelProto, tensors: list[str]) -> dict[str, str]:
    """Make ``tensors`` graph outputs of ``model`` (in place, as float32), those inside If branches included.

    A branch's tensor leaves each If it is nested in as an extra output (the other branch outputs an empty
    tensor in its place: a sample that does not run the branch gives no values). Returns, by tensor, the
    name to fetch it under (its own in the main graph; ``<name>/exposed`` from inside a branch).
    """
    found = _expose_in(model.graph, set(tensors), 0)
    present = {o.name for o in model.graph.output}
    for tensor in tensors:
        name = found.get(tensor, tensor)
        if name not in present:
            model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            present.add(name)
    return {tensor: found.get(tensor, tensor) for tensor in tensors}


def _expose_in(graph: onnx.GraphProto, wanted: set[str], depth: int) -> dict[str, str]:
    """Of ``wanted``, the tensors ``graph`` defines or its If branches expose, and their names in ``graph``."""
    defined = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    defined.update(name for node in graph.node for name in node.output)
    here = {t: t for t in wanted & defined}
    for node in list(graph.node):
        branches = [a for a in node.attribute if node.op_type == "If" and a.name in BRANCH_ATTRIBUTES]
        inner = [_expose_in(a.g, wanted - here.keys(), depth + 1) for a in branches]
        names = sorted({t for found in inner for t in found} - here.keys())
        for attr, found in zip(branches, inner, strict=True):
            outputs = {o.name for o in attr.g.output}
            for tensor in names:
                source = found.get(tensor)
                if source is not None and source in outputs:  # already the branch's output: a copy goes out
                    copy = f"{source}/copy/{depth}"
                    attr.g.node.append(helper.make_node("Identity", [source], [copy]))
                    source = copy
                if source is None:  # this branch does not define it: an empty tensor stands in
                    source = f"{tensor}/absent/{depth}/{attr.name}"
                    empty = onnx.numpy_helper.from_array(np.zeros((0,), np.float32))
                    attr.g.node.append(helper.make_node("Constant", [], [source], value=empty))
                attr.g.output.append(helper.make_tensor_value_info(source, onnx.TensorProto.FLOAT, None))
        for tensor in names:
            here[tensor] = f"{tensor}/exposed" if depth == 0 else f"{tensor}/exposed/{depth}"
            node.output.append(here[tensor])
    return here
