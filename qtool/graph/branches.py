"""The bodies of a main graph's If, Loop and Scan nodes, each as a model of its own the whole pipeline can quantize.

A body ("branch": an If's then or else branch, a Loop's or a Scan's body) reads the scopes around it. As a
model, its formal inputs and the outer values it reads become its inputs (typed from the main graph) and the
outer constants only it reads become its own initializers, so a body quantized with integer kernels holds its
integer weights beside its Q/DQ nodes, where onnxruntime fuses them (it does not fuse a weight dequantized in
the outer scope). A constant another node or body reads as well stays outer (an input of the body's model):
it is stored once, in the main graph. Control flow nested in a body is that model's own, in turn.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

from qtool.graph.index import GraphView, all_nodes, node_subgraphs

BODY_ATTRIBUTES = {"If": ("then_branch", "else_branch"), "Loop": ("body",), "Scan": ("body",)}
LOOPS = ("Loop", "Scan")  # their bodies run once per iteration: a tensor comes out stacked over iterations


@dataclass(frozen=True)
class Branch:
    """One body of one If, Loop or Scan node of a main graph."""

    owner: str  # the node's name
    attribute: str  # then_branch, else_branch or body

    @property
    def label(self) -> str:
        return f"{self.owner}'s {self.attribute}"


def control_bodies(model: onnx.ModelProto) -> list[Branch]:
    """Every body of every If, Loop and Scan node of ``model``'s main graph, in graph order (named nodes only)."""
    return [
        Branch(node.name, attr.name)
        for node in model.graph.node
        if node.name and node.domain in ("", "ai.onnx")
        for attr in node.attribute
        if attr.name in BODY_ATTRIBUTES.get(node.op_type, ()) and attr.HasField("g")
    ]


def branch_graph(model: onnx.ModelProto, branch: Branch) -> onnx.GraphProto:
    """The branch's graph inside ``model``."""
    owner = next(node for node in model.graph.node if node.name == branch.owner)
    return next(a.g for a in owner.attribute if a.name == branch.attribute)


def branch_model(
    model: onnx.ModelProto, branch: Branch, view: GraphView | None = None, owned: Collection[str] | None = None
) -> onnx.ModelProto:
    """The branch as a model (see the module): outer values as inputs, the constants only it reads as its own.

    ``owned``: :func:`owned_constants` of the branch, when the caller has them.
    """
    g = view if view is not None else GraphView(model)
    body = branch_graph(model, branch)
    local = defined_names(body)
    outer = sorted(
        {name for node in all_nodes(body) for name in node.input if name and name not in local},
        key=lambda n: (n not in g.initializers, n),
    )
    owned = set(owned if owned is not None else owned_constants(model, branch, g))
    initializers = [*body.initializer, *(g.initializers[name] for name in outer if name in owned)]
    inputs = [*body.input, *(_typed(g, name) for name in outer if name not in owned)]
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
            for sub in _graphs_of(attr):
                elsewhere.update(name for inner in all_nodes(sub) for name in inner.input if name)
    return sorted(read_here - elsewhere)


def defined_names(graph: onnx.GraphProto, skip: tuple[str, str] | None = None) -> set[str]:
    """Every name ``graph`` defines at any depth (inputs, constants, node outputs), but inside body ``skip``.

    ``skip``: (node name, attribute) of one body left out.
    """
    names = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.output)
        for attr in node.attribute:
            if skip != (node.name, attr.name):
                names.update(name for sub in _graphs_of(attr) for name in defined_names(sub))
    return names


def _graphs_of(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return [attr.g] if attr.HasField("g") else list(attr.graphs)


def _typed(g: GraphView, name: str) -> onnx.ValueInfoProto:
    """An outer value as an input of a branch's model, with the main graph's element type and shape."""
    elem = g.elem_types.get(name, onnx.TensorProto.FLOAT)
    shape = g.shapes.get(name)
    return helper.make_tensor_value_info(name, elem, shape)


def expose(model: onnx.ModelProto, tensors: list[str]) -> dict[str, str]:
    """Make ``tensors`` graph outputs of ``model`` (in place, as float32), those inside bodies included.

    A branch's tensor leaves each If it is nested in as an extra output (the other branch outputs an empty
    tensor in its place: a sample that does not run the branch gives no values). A Loop's or Scan's
    tensor leaves it as an extra scan output, stacked over the iterations, where its shape is the same in
    every iteration (known from shape inference; control flow nested in a loop body is not exposed).
    Returns, by tensor, the name to fetch it under (its own in the main graph; ``<name>/exposed`` from a body);
    a tensor that cannot be exposed is left out (it is not observed).
    """
    loops = any(node.op_type in LOOPS for node in all_nodes(model.graph))
    static = _static_names(model) if loops else set()  # shape inference only where a loop needs it
    found = _expose_in(model.graph, set(tensors), 0, static)
    present = {o.name for o in model.graph.output}
    for tensor in tensors:
        name = found.get(tensor)
        if name is not None and name not in present:
            model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            present.add(name)
    return {tensor: found[tensor] for tensor in tensors if tensor in found}


def _expose_in(graph: onnx.GraphProto, wanted: set[str], depth: int, static: set[str]) -> dict[str, str]:
    """Of ``wanted``, the tensors ``graph`` defines or its bodies expose, and their names in ``graph``."""
    defined = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    defined.update(name for node in graph.node for name in node.output)
    here = {t: t for t in wanted & defined}
    for node in list(graph.node):
        attributes = BODY_ATTRIBUTES.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ()
        bodies = [a for a in node.attribute if a.name in attributes and a.HasField("g")]
        if node.op_type in LOOPS:  # stacked over iterations: only what each iteration writes alike
            inner = [{t: t for t in wanted - here.keys() if t in static and t in _iterated(a.g)} for a in bodies]
        else:
            inner = [_expose_in(a.g, wanted - here.keys(), depth + 1, static) for a in bodies]
        names = sorted({t for found in inner for t in found} - here.keys())
        for attr, found in zip(bodies, inner, strict=True):
            _add_outputs(attr.g, names, found, f"{depth}/{attr.name}")
        for tensor in names:
            here[tensor] = f"{tensor}/exposed" if depth == 0 else f"{tensor}/exposed/{depth}"
            node.output.append(here[tensor])
        if node.op_type == "Scan" and names:  # each new scan output stacked along axis 0, forward
            for attr in node.attribute:
                if attr.name in ("scan_output_axes", "scan_output_directions"):
                    attr.ints.extend([0] * len(names))
    return here


def _add_outputs(body: onnx.GraphProto, names: list[str], found: dict[str, str], tag: str) -> None:
    """Output each of ``names`` from ``body``: its own value, a copy of an output, or an empty stand-in."""
    taken = {o.name for o in body.output} | {i.name for i in body.input}
    for tensor in names:
        source = found.get(tensor)
        if source is not None and source in taken:  # already the body's output, or its input: a copy goes out
            copy = f"{source}/copy/{tag}"
            body.node.append(helper.make_node("Identity", [source], [copy]))
            source = copy
        if source is None:  # this branch does not define it: an empty tensor stands in
            source = f"{tensor}/absent/{tag}"
            empty = onnx.numpy_helper.from_array(np.zeros((0,), np.float32))
            body.node.append(helper.make_node("Constant", [], [source], value=empty))
        body.output.append(helper.make_tensor_value_info(source, onnx.TensorProto.FLOAT, None))


def _iterated(body: onnx.GraphProto) -> set[str]:
    """What takes a value in every iteration of a loop body: its inputs and what its own nodes write."""
    return {i.name for i in body.input} | {name for node in body.node for name in node.output}


def _static_names(model: onnx.ModelProto) -> set[str]:
    """Tensors, at any depth, whose every dimension shape inference knows (empty when it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return set()
    found: set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        for value in [*graph.value_info, *graph.output, *graph.input]:
            dims = value.type.tensor_type.shape.dim
            if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                found.add(value.name)
        for node in graph.node:
            for sub in node_subgraphs(node):
                walk(sub)

    walk(inferred.graph)
    return found
