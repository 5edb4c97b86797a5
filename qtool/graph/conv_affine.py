"""Per-channel affine ops after a Conv, folded into its weight and bias.

Exporters leave a Conv's output scaled and shifted by separate nodes: inference-mode BatchNormalization,
and constant Mul/Add/Sub/Div (PP-LCNetV3's learnable affine block, a paddle2onnx ``scale`` op, a TensorFlow
bias add written apart). Each is ``y = x * a + b`` per output channel, so ``W' = W * a`` and ``B' = B * a + b``
compute the same values (to float rounding) in the Conv alone: one op fewer for onnxruntime to run, and for an
integer Conv no float op between it and its quantizer. A node is folded only when it is the Conv's one reader,
its other operand a constant that varies along the channel axis at most, and the Conv's weight read by no other
node; the Conv then writes the folded node's output (its name unchanged for the rest of the graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphView, subgraph_reads
from qtool.graph.names import fresh_name
from qtool.graph.weights import Weights

_ARITHMETIC = frozenset({"Mul", "Add", "Sub", "Div"})


@dataclass(frozen=True)
class _Affine:
    """``y = x * scale + shift`` on the data input ``x``; ``dims`` the constant's shape (None: one per channel)."""

    x: str
    scale: np.ndarray
    shift: np.ndarray
    dims: tuple[int, ...] | None


def fold_conv_affine(graph: onnx.GraphProto, weights: Weights) -> tuple[list[str], list[str]]:
    """Fold BatchNormalization and constant Mul/Add/Sub/Div into the Conv before them (main graph).

    Returns the BatchNormalization nodes and the arithmetic nodes folded. Detached values are read from and
    replaced in ``weights``.
    """
    batchnorms: list[str] = []
    arithmetic: list[str] = []
    while True:  # a Conv -> Mul -> Add folds one node per pass: the Conv writes the Mul's output after the first
        view = GraphView(graph)
        protected = view.graph_outputs | {name for node in view.nodes for name in subgraph_reads(node)}
        removed = set()
        for node in view.nodes:
            x = _data_input(view, node)
            conv = view.producer(x) if x is not None else None
            if conv is None or not _foldable(view, conv, protected):
                continue  # (checked before any constant is read: most Adds and Muls follow no Conv)
            affine = _affine(view, node, weights)
            if affine is None or not _fold(graph, view, conv, affine, weights):
                continue
            conv.output[0] = node.output[0]
            removed.add(node.name)
            (batchnorms if node.op_type == "BatchNormalization" else arithmetic).append(node.name)
        if not removed:
            return batchnorms, arithmetic
        kept = [node for node in graph.node if node.name not in removed]
        del graph.node[:]
        graph.node.extend(kept)


def _data_input(view: GraphView, node: onnx.NodeProto) -> str | None:
    """The input ``x`` of a node that may be ``x * a + b`` per channel (its other operands constants), else None."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.name or not node.input:
        return None
    if node.op_type == "BatchNormalization":
        return node.input[0]
    if node.op_type not in _ARITHMETIC or len(node.input) != 2:
        return None
    x, operand = _operands(view, node)
    return x if x not in view.initializers and operand in view.initializers else None  # not Sub(b, x), Div(a, x)


def _operands(view: GraphView, node: onnx.NodeProto) -> tuple[str, str]:
    """An arithmetic node's (data, constant) inputs: as written, or swapped for ``3 * x`` and ``b + x``."""
    x, operand = node.input
    if node.op_type in ("Mul", "Add") and x in view.initializers:
        return operand, x
    return x, operand


def _affine(view: GraphView, node: onnx.NodeProto, weights: Weights) -> _Affine | None:
    """``node`` as ``x * scale + shift`` (``node`` one :func:`_data_input` accepts), or None when it is not."""
    if node.op_type == "BatchNormalization":
        return _batchnorm(view, node, weights)
    x, operand = _operands(view, node)
    constant = view.initializers[operand]
    if constant.data_type != onnx.TensorProto.FLOAT:
        return None
    value = weights.value(constant).astype(np.float64)
    if node.op_type == "Div" and np.any(value == 0):
        return None
    ones, zeros, dims = np.ones_like(value), np.zeros_like(value), tuple(constant.dims)
    if node.op_type == "Mul":
        return _Affine(x, value, zeros, dims)
    if node.op_type == "Div":
        return _Affine(x, 1.0 / value, zeros, dims)
    return _Affine(x, ones, value if node.op_type == "Add" else -value, dims)


def _batchnorm(view: GraphView, node: onnx.NodeProto, weights: Weights) -> _Affine | None:
    """A BatchNormalization in inference mode: ``gamma / sqrt(var + eps)``, ``beta - mean * that`` per channel."""
    if len(node.input) != 5 or not all(name in view.initializers for name in node.input[1:]):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("training_mode", 0) or attrs.get("spatial", 1) == 0:
        return None
    eps = attrs.get("epsilon", 1e-5)
    if not isinstance(eps, float):
        return None  # a malformed attribute: left for onnxruntime to judge
    gamma, beta, mean, var = (weights.value(view.initializers[n]).astype(np.float64) for n in node.input[1:])
    if len({p.shape for p in (gamma, beta, mean, var)}) != 1 or gamma.ndim != 1:
        return None
    factor = gamma / np.sqrt(var + eps)
    return _Affine(node.input[0], factor, beta - mean * factor, None)


def _foldable(view: GraphView, conv: onnx.NodeProto, protected: set[str]) -> bool:
    """Whether ``conv`` may take its reader in: its output read by that node alone, its weight and bias constants."""
    if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or conv.output[0] in protected:
        return False
    if len(view.input_readers(conv.output[0])) != 1 or len(conv.input) < 2 or conv.input[1] not in view.initializers:
        return False
    if len(conv.input) > 2 and conv.input[2] and conv.input[2] not in view.initializers:
        return False
    # the weight is shared with another node: folding would change that node too
    return len(view.input_readers(conv.input[1])) == 1 and conv.input[1] not in protected


def _fold(graph: onnx.GraphProto, view: GraphView, conv: onnx.NodeProto, affine: _Affine, weights: Weights) -> bool:
    """``conv``'s weight times the scale, its bias times the scale plus the shift; False when they do not fit."""
    weight_init = view.initializers[conv.input[1]]
    weight = weights.value(weight_init)
    channels = weight.shape[0] if weight.ndim >= 3 else 0
    scale, shift = (_per_channel(part, affine.dims, weight.ndim, channels) for part in (affine.scale, affine.shift))
    has_bias = len(conv.input) > 2 and bool(conv.input[2])
    bias = weights.value(view.initializers[conv.input[2]]).astype(np.float64) if has_bias else np.zeros(channels)
    if scale is None or shift is None or bias.shape != (channels,):
        return False
    new_weight = (weight.astype(np.float64) * scale.reshape(-1, *([1] * (weight.ndim - 1)))).astype(weight.dtype)
    new_bias = (bias * scale + shift).astype(weight.dtype)
    weights.replace(weight_init, new_weight)
    if has_bias and len(view.input_readers(conv.input[2])) == 1 and conv.input[2] not in view.graph_outputs:
        weights.replace(view.initializers[conv.input[2]], new_bias)
        return True
    taken = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}
    bias_name = fresh_name(f"{conv.name or conv.output[0]}/folded_bias", taken)
    graph.initializer.append(numpy_helper.from_array(new_bias, bias_name))
    while len(conv.input) < 3:
        conv.input.append("")
    conv.input[2] = bias_name
    return True


def _per_channel(value: np.ndarray, dims: tuple[int, ...] | None, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as one number per output channel of a ``rank``-D Conv output, or None if it varies otherwise.

    ``dims`` None: already one per channel. Else the constant's shape, which broadcasts right-aligned against
    ``[N, C, spatial...]``: only the channel axis may differ from 1, and it must not widen the output's rank.
    """
    if channels <= 0:
        return None
    if dims is None:
        return value if value.shape == (channels,) else None
    if len(dims) > rank:
        return None
    padded = (1,) * (rank - len(dims)) + dims
    if padded[0] != 1 or padded[1] not in (1, channels) or any(d != 1 for d in padded[2:]):
        return None
    return np.broadcast_to(value.reshape(-1), (channels,)).astype(np.float64)
