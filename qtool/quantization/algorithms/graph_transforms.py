"""The algorithms that rewrite the float model before calibration: equalization, then SmoothQuant.

They run in ``calibrate`` and in ``quantize`` alike, so that statistics always describe the
model that gets quantized. Equalization depends on the weights only; the statistics file records
the pairs it equalized, and ``quantize --stats`` refuses a config that equalizes others.
SmoothQuant depends on the data (each activation channel's abs max); those maxima are written
into the statistics file, and ``quantize --stats`` smooths with them instead of reading the data again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from qtool.config import QConfig
from qtool.graph.weights import Weights
from qtool.quantization.algorithms.equalization import EqualizationReport, equalize
from qtool.quantization.algorithms.smoothing import SmoothingReport, channel_absmax, smooth
from qtool.quantization.roles import HANDLERS, GraphIndex


@dataclass
class ChannelMaxima:
    """A float-pass tap: the per-channel abs max (last axis) of the tensors SmoothQuant may smooth."""

    names: list[str]
    maxima: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def tensors(self) -> list[str]:
        return self.names

    def observe(self, values: dict[str, np.ndarray], count: int, feed: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            batch = channel_absmax(value)
            known = self.maxima.get(name)
            self.maxima[name] = batch if known is None else np.maximum(known, batch)


def smoothing_nodes(model: onnx.ModelProto, config: QConfig) -> dict[str, str]:
    """MatMul/Gemm nodes whose config turns SmoothQuant on -> the activation tensor each reads."""
    g = GraphIndex(model)
    chosen: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
            continue
        scheme = config.scheme_for(node.name, node.op_type)
        if scheme is None or not scheme.algorithms.smoothquant:
            continue
        roles = HANDLERS[node.op_type](node, g)
        if isinstance(roles, str) or roles.weight is None or node.input[1] != roles.weight.name:
            continue
        chosen[node.name] = node.input[0]
    return chosen


def apply_smoothing(
    model: onnx.ModelProto, store: Weights, config: QConfig, maxima: dict[str, np.ndarray]
) -> tuple[onnx.ModelProto, SmoothingReport]:
    """``model`` with the activations of its SmoothQuant nodes smoothed, each node at its own migration strength."""
    nodes = smoothing_nodes(model, config)
    op_types = {n.name: n.op_type for n in model.graph.node}

    def alpha(name: str) -> float:
        scheme = config.scheme_for(name, op_types[name])
        return scheme.algorithms.smoothquant_alpha if scheme is not None else 0.5

    return smooth(model, store, maxima, frozenset(nodes), alpha=alpha)


def apply_equalization(
    model: onnx.ModelProto, store: Weights, config: QConfig
) -> tuple[onnx.ModelProto, EqualizationReport]:
    """``model`` with the Conv chains whose nodes all turn ``equalization`` on equalized (data-free)."""
    chosen = set()
    for node in model.graph.node:
        scheme = config.scheme_for(node.name, node.op_type) if node.op_type in HANDLERS else None
        if scheme is not None and scheme.algorithms.equalization:
            chosen.add(node.name)
    if not chosen:
        return model, EqualizationReport((), (), (), 0)
    return equalize(model, store, frozenset(chosen))
