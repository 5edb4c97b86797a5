"""The one read-only view of a model's main graph that every stage looks things up in.

Nodes in order, who writes and who reads each tensor (an If/Loop/Scan also reads, implicitly,
every outer tensor its bodies use), the constants, element types, shapes and the graph's inputs
and outputs. A view describes the model as it was when built: a pass that rewrites the model
builds a new one.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, numpy_helper

BODY = -1  # the input slot recorded for a tensor a node reads inside one of its bodies


def node_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies of one If/Loop/Scan (or any node with graph attributes)."""
    return [sub for attr in node.attribute for sub in ([attr.g] if attr.HasField("g") else attr.graphs)]


def all_subgraphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """Every subgraph of ``graph``'s nodes, depth first."""
    return [body for node in graph.node for sub in node_subgraphs(node) for body in [sub, *all_subgraphs(sub)]]


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` and of every subgraph in it."""
    return [*graph.node, *(inner for node in graph.node for sub in node_subgraphs(node) for inner in all_nodes(sub))]


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names read inside ``node``'s bodies, at any depth: the outer-scope values it uses implicitly.

    Names local to the bodies are included too; ONNX forbids a body to reuse an outer name, so
    such a name never stands for an outer tensor.
    """
    return {name for sub in node_subgraphs(node) for inner in all_nodes(sub) for name in inner.input if name}


class GraphView:
    """Lookups over a model's main graph."""

    def __init__(self, model: onnx.ModelProto | onnx.GraphProto) -> None:
        graph = model.graph if isinstance(model, onnx.ModelProto) else model
        self.nodes = list(graph.node)
        self.by_name = {node.name: node for node in self.nodes if node.name}  # node name -> node
        self.positions = {node.name: index for index, node in enumerate(self.nodes) if node.name}  # name -> index
        self.graph_inputs = {value.name for value in graph.input}
        self.graph_outputs = {value.name for value in graph.output}
        # Every initializer by name, also one that is a graph input (overridable at run time: not a constant).
        self.every_initializer = {i.name: i for i in graph.initializer}
        self.initializers = {name: i for name, i in self.every_initializer.items() if name not in self.graph_inputs}
        self.elem_types: dict[str, int] = {}
        self.shapes: dict[str, list[int | str]] = {}
        for value in [*graph.input, *graph.value_info, *graph.output]:
            if value.type.HasField("tensor_type"):
                tensor_type = value.type.tensor_type
                self.elem_types[value.name] = tensor_type.elem_type
                if tensor_type.HasField("shape"):
                    self.shapes[value.name] = [d.dim_value or d.dim_param for d in tensor_type.shape.dim]
        for init in graph.initializer:
            self.elem_types[init.name] = init.data_type
        self.producers: dict[str, int] = {}  # tensor -> index of the node that writes it
        self.readers: dict[str, list[tuple[int, int]]] = {}  # tensor -> (node index, input slot or BODY)
        self.consumers: dict[str, list[onnx.NodeProto]] = {}  # tensor -> the nodes reading it, each once
        for index, node in enumerate(self.nodes):
            for name in node.output:
                if name:
                    self.producers[name] = index
            body = sorted(subgraph_reads(node))
            for slot, name in [*enumerate(node.input), *((BODY, name) for name in body)]:
                if name:
                    self.readers.setdefault(name, []).append((index, slot))
            for name in dict.fromkeys([*node.input, *body]):
                if name:
                    self.consumers.setdefault(name, []).append(node)

    def producer(self, name: str) -> onnx.NodeProto | None:
        """The node that writes ``name`` (None: a graph input, a constant or unknown)."""
        index = self.producers.get(name)
        return None if index is None else self.nodes[index]

    def input_readers(self, name: str) -> list[onnx.NodeProto]:
        """The nodes reading ``name`` as an input, once per input slot (bodies' reads left out)."""
        return [self.nodes[index] for index, slot in self.readers.get(name, []) if slot != BODY]

    def is_float(self, name: str) -> bool:
        return self.elem_types.get(name) == TensorProto.FLOAT

    def rank(self, name: str) -> int:
        """The rank of the constant ``name``."""
        return len(self.initializers[name].dims)

    def label(self, index: int) -> str:
        """How node ``index`` is named in messages (its name, or its first output)."""
        node = self.nodes[index]
        return node.name or node.output[0]

    def scalar(self, name: str) -> float | None:
        """The value of a one-element constant, else None."""
        tensor = self.initializers.get(name)
        if tensor is None or tensor.data_location == TensorProto.EXTERNAL:
            return None
        values = numpy_helper.to_array(tensor)
        return float(values.reshape(-1)[0]) if values.size == 1 else None

    def clip_bounds(self, clip: onnx.NodeProto) -> tuple[float | None, float | None]:
        """A Clip's constant bounds (None: absent, or not a constant): inputs 1 and 2 from opset 11, else attributes."""
        if len(clip.input) > 1:
            bounds = [self.scalar(name) if name else None for name in (*clip.input[1:3], "")[:2]]
            return bounds[0], bounds[1]
        attributes = {a.name: a.f for a in clip.attribute}
        return attributes.get("min"), attributes.get("max")

    def sole_reader(self, tensor: str) -> tuple[int, int] | None:
        """The one (node, slot) reading ``tensor``, if exactly one does and it is no graph output."""
        readers = self.readers.get(tensor, [])
        return readers[0] if len(readers) == 1 and tensor not in self.graph_outputs else None
