"""SmoothQuant's side of the graph: the nodes it smooths, the channel maxima it reads, the smoothing itself.

The maxima (each activation channel's abs max) come from a float pass (:class:`ChannelMaxima`) and
are written into the statistics file, so that ``quantize --stats`` smooths with them instead of
reading the data again. The graph edit is :func:`~qtool.quantization.algorithms.transforms.smoothing.smooth`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from qtool.graph.index import GraphView
from qtool.graph.weights import Weights
from qtool.quantization.algorithms.transforms.channel_taps import TensorTap
from qtool.quantization.algorithms.transforms.smoothing import SmoothingReport, smooth
from qtool.quantization.algorithms.transforms.smoothing_scales import channel_absmax
from qtool.quantization.plan.records import QuantPlan


@dataclass
class ChannelMaxima(TensorTap):
    """A float-pass tap: the per-channel abs max (last axis) of the tensors SmoothQuant may smooth."""

    maxima: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, name: str, value: np.ndarray) -> None:
        """Raise ``name``'s channel maxima to this batch's."""
        batch = channel_absmax(value)
        known = self.maxima.get(name)
        self.maxima[name] = batch if known is None else np.maximum(known, batch)


def smoothing_nodes(plan: QuantPlan, model: onnx.ModelProto) -> dict[str, str]:
    """The plan's MatMul/Gemm nodes that turn SmoothQuant on -> the activation tensor each reads."""
    nodes = GraphView(model).by_name
    return {
        node.name: nodes[node.name].input[0]
        for node in plan.nodes
        if node.op_type in ("MatMul", "Gemm")
        and node.scheme.algorithms.smoothquant
        and node.weight is not None
        and nodes[node.name].input[1] == node.weight.name
    }


def apply_smoothing(
    model: onnx.ModelProto, store: Weights, plan: QuantPlan, maxima: dict[str, np.ndarray]
) -> tuple[onnx.ModelProto, SmoothingReport]:
    """``model`` with the activations of its SmoothQuant nodes smoothed, each node at its own migration strength."""
    nodes = smoothing_nodes(plan, model)
    alphas = {node.name: node.scheme.algorithms.smoothquant_alpha for node in plan.nodes}
    return smooth(model, store, maxima, frozenset(nodes), alpha=lambda name: alphas[name])
