"""Weights a Loop carries as state it never changes: read from the outer scope instead, so they can be quantized.

tf2onnx writes a Keras LSTM/GRU as a Loop whose kernel and recurrent kernel enter as loop-carried state, start
from initializers and leave each iteration unchanged (the body returns its input as it came, or through
Identity); paddle2onnx does the same with a decoder's weights. Inside the body such a weight is a body input,
not a constant, and nothing there could be quantized. A state that starts from an initializer and is passed
through unchanged has that initializer's value in every iteration: :func:`read_constant_loop_state` makes the
body's nodes read the initializer itself (bodies may read outer values), and the state stays as it was.
"""

from __future__ import annotations

import onnx

from qtool.graph.index import GraphView, all_nodes


def read_constant_loop_state(graph: onnx.GraphProto) -> list[str]:
    """Make the bodies of ``graph``'s Loops read the constant state they carry unchanged; returns the Loops changed."""
    constants = {init.name for init in graph.initializer}
    changed = []
    for node in graph.node:
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
            continue
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        if body is None:
            continue
        renamed = {}
        view = GraphView(body)
        states = zip(node.input[2:], body.input[2:], body.output[1:], strict=False)
        for start, state_in, state_out in states:
            if start in constants and _passed_through(view, state_in.name, state_out.name):
                renamed[state_in.name] = start
        if renamed:
            for inner in all_nodes(body):  # nested bodies read the outer value too
                inner.input[:] = [renamed.get(name, name) for name in inner.input]
            changed.append(node.name)
    return changed


def _passed_through(body: GraphView, state_in: str, state_out: str) -> bool:
    """Whether the body returns ``state_in`` unchanged as ``state_out`` (the same name, or through Identity)."""
    name = state_out
    while name != state_in:
        node = body.producer(name)
        if node is None or node.op_type != "Identity":
            return False
        name = node.input[0]
    return True
