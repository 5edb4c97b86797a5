"""Readers of a quantized tensor that must read its float value: onnxruntime's QDQ propagation fails on them.

onnxruntime's ``QDQPropagationTransformer`` (1.32 and before) moves a DequantizeLinear forward past the ops
that only move values (:data:`PROPAGATING`), inserting a Q/DQ pair on each edge after them. When such an
op's output is read inside an If/Loop/Scan body (an implicit input of the control-flow node), the edge
it rewires does not exist among that node's explicit inputs and the session aborts the process
(``stl_vector.h: Assertion '__n < this->size()' failed``: no exception, no message). Silero VAD's
Relu -> Transpose -> If is such a graph. A value-moving op whose results reach a body that way reads the
float tensor instead: nothing is lost (it computes in float), and nothing is propagated through it.
"""

from __future__ import annotations

import onnx

from qtool.graph.index import GraphView, subgraph_reads

PROPAGATING = frozenset({"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})


def read_float_before_bodies(view: GraphView, tensor: str, float_name: str, planned: set[str]) -> None:
    """Make the unplanned value-moving readers of ``tensor`` whose outputs a body reads read ``float_name``."""
    movers = [n for n in view.consumers.get(tensor, []) if n.op_type in PROPAGATING and n.name not in planned]
    read_in_bodies = {name for node in view.nodes for name in subgraph_reads(node)} if movers else set()
    for node in movers:
        if read_in_bodies and _reaches(view, node, read_in_bodies, set()):
            node.input[:] = [float_name if name == tensor else name for name in node.input]


def _reaches(view: GraphView, node: onnx.NodeProto, read_in_bodies: set[str], seen: set[str]) -> bool:
    """Whether ``node``'s first output, or that of a value-moving op after it, is read inside a body."""
    if not node.output or node.name in seen:
        return False
    seen.add(node.name)
    out = node.output[0]
    if out in read_in_bodies:
        return True
    return any(
        user.op_type in PROPAGATING and _reaches(view, user, read_in_bodies, seen)
        for user in view.consumers.get(out, [])
    )
