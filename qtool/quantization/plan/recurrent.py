"""Recurrent ops' weights (LSTM, GRU, RNN): stored quantized, restored at load, computed in float.

onnxruntime has no static integer kernel for a recurrent op, so such a node cannot be an integer
kernel between Quantize/DequantizeLinear; but its input weight W and recurrence weight R are usually
most of a CRNN recogniser's or a speech model's bytes. Each is stored like a storage-placed node's weight
(:mod:`qtool.quantization.emit.body_weights`): integers in the file, restored to float when the session
starts, so the op runs as before at fp32 speed. Both are ``[directions, gates x hidden, width]``: per-channel
scales lie along axis 1, one per gate row (shared by the two directions of a bidirectional op). The bias,
initial states and peepholes stay float. The config's rules decide each node's weight dtype and
granularity as for any node (``op_type: {LSTM: null}`` keeps them float).
"""

from __future__ import annotations

from onnx import TensorProto

from qtool.config import QConfig
from qtool.graph.index import GraphView
from qtool.quantization.plan.records import STORED_DTYPES, StoredWeightPlan

RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})
RECURRENT_WEIGHT_INPUTS = (1, 2)  # W (input weights) and R (recurrence weights)
GATE_ROWS = 1  # [directions, gates x hidden, width]: one scale per gate row


def plan_recurrent_weights(g: GraphView, config: QConfig) -> tuple[StoredWeightPlan, ...]:
    """The W and R weights of the graph's recurrent nodes that ``config`` stores quantized, each weight once."""
    constants = g.every_initializer
    plans: dict[str, StoredWeightPlan] = {}
    for node in g.nodes:
        if node.op_type not in RECURRENT_OPS or node.domain not in ("", "ai.onnx"):
            continue
        scheme, rule = config.resolve(node.name, node.op_type)
        if scheme is None or scheme.weight.dtype not in STORED_DTYPES:
            continue
        for index in RECURRENT_WEIGHT_INPUTS:
            weight = constants.get(node.input[index]) if len(node.input) > index else None
            if weight is None or weight.data_type != TensorProto.FLOAT or len(weight.dims) != 3:
                continue
            axis = None if scheme.weight.granularity == "per_tensor" else GATE_ROWS
            plan = StoredWeightPlan(node.name, "", node.name, node.op_type, weight.name, scheme.weight, axis, rule)
            plans.setdefault(weight.name, plan)
    return tuple(plans.values())


def recurrent_reason(plan: StoredWeightPlan) -> str:
    """Why a recurrent node's weight is stored and its compute float, for the reports."""
    return f"{plan.op_type}: no static integer kernel in onnxruntime; weights stored quantized, restored at load"
