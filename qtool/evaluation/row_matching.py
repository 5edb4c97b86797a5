"""Outputs whose rows a selection in the graph picks and orders, compared as sets of rows.

A detector exported with its selection inside (an NMS-free YOLO's ``[1, 300, 6]``: the best rows picked and
sorted by a ``TopK``; boxes gathered after a ``NonMaxSuppression``) returns rows in score order. Where two
scores nearly tie, a quantized model returns them the other way round, and an element-wise error then
measures the tie, not the model. Such an output is compared after each of the candidate's rows is paired
with a row of the reference's, nearest pairs first (a greedy assignment on the squared distance), so the
same detections in another order cost nothing and a detection that moved costs what it moved.
"""

from __future__ import annotations

import numpy as np
import onnx

from qtool.graph.index import GraphView

SELECTING_OPS = ("TopK", "NonMaxSuppression")  # pick rows by score and order them
MAX_MATCHED_ROWS = 512  # more rows are compared in place (the greedy assignment grows with the square)


def selection_ordered(model: onnx.ModelProto | GraphView) -> dict[str, str]:
    """The graph outputs computed from a TopK or NonMaxSuppression result: output -> the selecting node."""
    view = model if isinstance(model, GraphView) else GraphView(model)
    found: dict[str, str] = {}
    for node in view.nodes:
        if node.op_type not in SELECTING_OPS:
            continue
        reached, pending = set(), list(node.output)
        while pending:
            tensor = pending.pop()
            if tensor not in reached:
                reached.add(tensor)
                pending += [out for user in view.consumers.get(tensor, []) for out in user.output]
        for output in sorted(view.graph_outputs):
            if output in reached:
                found.setdefault(output, f"{node.op_type} '{node.name}'" if node.name else node.op_type)
    return found


def matched_rows(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """``candidate`` with its rows (the last axis is a row) reordered to pair with ``reference``'s, nearest first.

    Returned as it is when the shapes differ, when there is one row, or more than :data:`MAX_MATCHED_ROWS`.
    """
    if reference.shape != candidate.shape or reference.ndim == 0:
        return candidate
    width = reference.shape[-1] if reference.ndim >= 2 else 1
    ref = reference.reshape(-1, width).astype(np.float64)
    cand = candidate.reshape(-1, width).astype(np.float64)
    rows = ref.shape[0]
    if rows < 2 or rows > MAX_MATCHED_ROWS or not (np.isfinite(ref).all() and np.isfinite(cand).all()):
        return candidate
    cost = np.square(ref).sum(1)[:, None] + np.square(cand).sum(1)[None, :] - 2.0 * (ref @ cand.T)
    pick = np.full(rows, -1)
    taken = np.zeros(rows, bool)
    left = rows
    for flat in np.argsort(cost, axis=None, kind="stable"):
        i, j = divmod(int(flat), rows)
        if pick[i] >= 0 or taken[j]:
            continue
        pick[i], taken[j] = j, True
        left -= 1
        if not left:
            break
    return candidate.reshape(-1, width)[pick].reshape(candidate.shape)
