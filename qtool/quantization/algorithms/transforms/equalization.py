"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization"): even out per-channel weight ranges.

A positive per-channel scale passes through ReLU-like ops: ``W2 f(W1 x + b1) = (W2 S) f(S^-1 (W1 x + b1))``.
With ``s_i = sqrt(r1_i / r2_i)`` (``r1_i``: the range of the first layer's output channel ``i``, ``r2_i``: of
the second layer's input channel ``i``) both get the range ``sqrt(r1_i r2_i)``, so a per-tensor or low-bit
weight quantizer no longer spends its levels on one outlying channel; the float outputs do not change.
Chains (Conv -> depthwise Conv -> Conv) share their middle layer, so the pairs are swept until the scales
settle. High-bias absorption then moves the part ``c_i = max(0, min_i)`` of a first layer's bias that the
ReLU never clips into the next layer's bias, which narrows the activation range the quantizer must cover.

Rescaled values are written under new initializer names (``<name>/equalized``): the input model, and any
other model sharing the :class:`~qtool.graph.weights.Weights` store, keep theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphView, all_nodes
from qtool.graph.names import fresh_name
from qtool.graph.weights import Weights
from qtool.quantization.algorithms.transforms.equalization_pairs import ScaledLayer, candidates, channels_problem, layer
from qtool.quantization.plan.records import QuantPlan

MAX_SCALE = 1e4  # one sweep's scale stays within [1 / MAX_SCALE, MAX_SCALE]
_SHIFT_SAFE = {"Relu", "MaxPool", "Identity"}  # relu(y) - c == relu(y - c) once y >= c >= 0; max and identity commute


@dataclass(frozen=True)
class EqualizedPair:
    """Two layers whose shared channels were rescaled, and the ops between them ("+"-joined, "" for none)."""

    first: str
    second: str
    activation: str


@dataclass(frozen=True)
class EqualizationSkip:
    """A pair left alone (or whose bias was not absorbed), and why."""

    first: str
    second: str
    reason: str


@dataclass(frozen=True)
class EqualizationReport:
    """What :func:`equalize` changed: the pairs, the first layers whose bias was absorbed, and what it skipped."""

    pairs: tuple[EqualizedPair, ...]
    absorbed: tuple[str, ...]
    skipped: tuple[EqualizationSkip, ...]
    sweeps: int  # sweeps over all pairs until the scales settled (0: no pair)


@dataclass(frozen=True)
class _RescaledPair:
    first: ScaledLayer
    second: ScaledLayer
    ops: tuple[str, ...]


@dataclass
class _Values:
    """Canonical float64 weights and biases (see :class:`ScaledLayer`) of the layers in pairs, by node index."""

    weights: dict[int, np.ndarray] = field(default_factory=dict)
    biases: dict[int, np.ndarray] = field(default_factory=dict)
    output_scales: dict[int, np.ndarray] = field(default_factory=dict)  # what each first layer's output was divided by


def equalization_nodes(plan: QuantPlan) -> frozenset[str]:
    """The plan's nodes that turn ``equalization`` on (a Conv chain is equalized when all its nodes do)."""
    return frozenset(node.name for node in plan.nodes if node.scheme.algorithms.equalization)


def equalize(
    model: onnx.ModelProto,
    store: Weights,
    nodes: Callable[[str], bool] | Set[str],
    *,
    iterations: int = 20,
    tolerance: float = 1e-3,
    clip_pairs: bool = False,
    absorb_high_bias: bool = True,
    channel_min: Mapping[str, np.ndarray] | None = None,
) -> tuple[onnx.ModelProto, EqualizationReport]:
    """Rescale the channels between consecutive layers so their weight ranges match; returns a new model.

    Args:
        model: a prepared float model (BatchNorm folded); it is not modified.
        store: holds ``model``'s detached values; the rescaled ones are added under new names.
        nodes: the node names that may be rescaled (both layers of a pair must be).
        iterations: the most sweeps over all pairs.
        tolerance: stop once no scale of a sweep is further than this from 1 (in ``|log s|``).
        clip_pairs: also equalize through a Clip with a max (Relu6). Not exact: the scaled model clips
            channel ``i`` at ``s_i * max`` instead of ``max``.
        absorb_high_bias: absorb biases when ``channel_min`` is given.
        channel_min: per-channel minimum of a first layer's output (before its activation) over calibration
            data, measured on ``model``, by tensor name. Absorption is exact on inputs within these minimums,
            and only done through Relu, MaxPool or nothing, into a layer that does not pad.

    Returns:
        The equalized model and the report.
    """
    graph = GraphView(model)
    selected = nodes if callable(nodes) else nodes.__contains__
    values = _Values()
    pairs, skipped = _pairs(graph, store, selected, clip_pairs, values)
    sweeps = _balance(pairs, values, iterations, tolerance)
    absorbed: list[str] = []
    if absorb_high_bias and channel_min is not None:
        absorbed = _absorb(pairs, values, channel_min, skipped)
    layers = {found.index: found for pair in pairs for found in (pair.first, pair.second)}
    equalized = _rewrite(model, store, layers, values)
    report = EqualizationReport(
        tuple(EqualizedPair(p.first.name, p.second.name, "+".join(p.ops)) for p in pairs),
        tuple(absorbed),
        tuple(skipped),
        sweeps,
    )
    return equalized, report


def _pairs(
    graph: GraphView, store: Weights, selected: Callable[[str], bool], clip_pairs: bool, values: _Values
) -> tuple[list[_RescaledPair], list[EqualizationSkip]]:
    """The pairs to equalize, with their canonical values loaded into ``values``, and the skipped ones."""
    pairs, skipped = [], []
    for candidate in candidates(graph, clip_pairs):
        first, second = layer(candidate.first, graph), layer(candidate.second, graph)
        names = graph.label(candidate.first), graph.label(candidate.second)
        problem = candidate.reason or _pair_problem(first, second, selected)
        if not problem and isinstance(first, ScaledLayer) and isinstance(second, ScaledLayer):
            for found in (first, second):
                _load(found, graph, store, values)
            problem = channels_problem(values.weights[first.index], values.weights[second.index], second.group)
        if problem or not isinstance(first, ScaledLayer) or not isinstance(second, ScaledLayer):
            skipped.append(EqualizationSkip(*names, problem))
            continue
        pairs.append(_RescaledPair(first, second, candidate.ops))
    return pairs, skipped


def _pair_problem(first: ScaledLayer | str, second: ScaledLayer | str, selected: Callable[[str], bool]) -> str:
    if isinstance(first, str) or isinstance(second, str):
        return first if isinstance(first, str) else str(second)
    if first.family != second.family:
        return f"{first.name} and {second.name} hold their channels on different axes"
    if second.second_problem:
        return f"{second.name}: {second.second_problem}"
    unselected = [found.name for found in (first, second) if not selected(found.name)]
    return f"{unselected[0]} is not selected" if unselected else ""


def _load(found: ScaledLayer, graph: GraphView, store: Weights, values: _Values) -> None:
    if found.index in values.weights:
        return
    weight = np.array(store.value(graph.initializers[found.weight]), dtype=np.float64)
    weight = np.ascontiguousarray(weight.T) if found.transposed else weight
    values.weights[found.index] = weight
    if found.bias is not None:
        bias = np.array(store.value(graph.initializers[found.bias]), dtype=np.float64)
        bias = bias.reshape(1) if bias.ndim == 0 else bias
        channels = weight.shape[0]
        values.biases[found.index] = np.array(np.broadcast_to(bias, (*bias.shape[:-1], channels)))


def _first_ranges(weight: np.ndarray) -> np.ndarray:
    return np.abs(weight.reshape(weight.shape[0], -1)).max(axis=1)


def _second_ranges(weight: np.ndarray, group: int) -> np.ndarray:
    per_group = weight.reshape(group, weight.shape[0] // group, weight.shape[1], -1)
    return np.abs(per_group).max(axis=(1, 3)).reshape(-1)


def _column_factor(weight: np.ndarray, group: int, scale: np.ndarray) -> np.ndarray:
    """``scale`` of each input channel, shaped to multiply the canonical ``weight`` of a grouped layer."""
    rows = weight.shape[0] // group
    factor = np.repeat(scale.reshape(group, 1, -1), rows, axis=1).reshape(weight.shape[0], weight.shape[1])
    return factor.reshape(*factor.shape, *([1] * (weight.ndim - 2)))


def _pair_scales(first: np.ndarray, second: np.ndarray, group: int) -> np.ndarray:
    """``s_i = sqrt(r1_i / r2_i)`` per shared channel; 1 for a channel dead in either layer."""
    r1, r2 = _first_ranges(first), _second_ranges(second, group)
    scale = np.ones_like(r1)
    live = (r1 > 0) & (r2 > 0)
    scale[live] = np.sqrt(r1[live] / r2[live])
    return np.clip(scale, 1.0 / MAX_SCALE, MAX_SCALE)


def _balance(pairs: list[_RescaledPair], values: _Values, iterations: int, tolerance: float) -> int:
    """Sweep the pairs in order until every scale is within ``tolerance`` of 1; returns the sweeps made."""
    for sweep in range(1, iterations + 1):
        worst = 0.0
        for pair in pairs:
            first, second = values.weights[pair.first.index], values.weights[pair.second.index]
            scale = _pair_scales(first, second, pair.second.group)
            first /= scale.reshape(-1, *([1] * (first.ndim - 1)))
            if pair.first.index in values.biases:
                values.biases[pair.first.index] /= scale
            second *= _column_factor(second, pair.second.group, scale)
            total = values.output_scales.get(pair.first.index, np.ones_like(scale))
            values.output_scales[pair.first.index] = total * scale
            worst = max(worst, float(np.abs(np.log(scale)).max(initial=0.0)))
        if worst < tolerance:
            return sweep
    return iterations if pairs else 0


def _absorb_problem(pair: _RescaledPair) -> str:
    if any(op not in _SHIFT_SAFE for op in pair.ops):
        return f"a bias is absorbed only through Relu or MaxPool, not {'+'.join(pair.ops)}"
    if pair.first.bias_node < 0:
        return f"{pair.first.name} has no bias to absorb from"
    if pair.second.bias_node < 0:
        return f"{pair.second.name} has no bias to absorb into"
    if pair.second.padded:
        return f"{pair.second.name} pads with zeros: an absorbed bias would be wrong at the borders"
    if pair.first.beta == 0 or pair.second.beta == 0:
        return "a Gemm with beta 0 ignores its bias"
    return ""


def _absorb(
    pairs: list[_RescaledPair], values: _Values, channel_min: Mapping[str, np.ndarray], skipped: list[EqualizationSkip]
) -> list[str]:
    """High-bias absorption: ``b1 -= c``, ``b2 += W2 c`` with ``c = max(0, min)``; returns the first layers."""
    absorbed = []
    for pair in pairs:
        first, second = pair.first, pair.second
        weight = values.weights[second.index]
        scale = values.output_scales.get(first.index, np.ones(weight.shape[1] * second.group))
        minimum = channel_min.get(first.output)
        if minimum is None or np.size(minimum) != scale.size:
            problem = (
                f"no channel minimum of '{first.output}'"
                if minimum is None
                else (f"the channel minimum of '{first.output}' has {np.size(minimum)} values, not {scale.size}")
            )
            skipped.append(EqualizationSkip(first.name, second.name, f"bias not absorbed: {problem}"))
            continue
        shift = np.maximum(0.0, np.asarray(minimum, np.float64).reshape(-1) / scale)
        problem = _absorb_problem(pair) if (shift > 0).any() else ""
        if problem:
            skipped.append(EqualizationSkip(first.name, second.name, f"bias not absorbed: {problem}"))
        if problem or not (shift > 0).any():
            continue
        taps = weight.reshape(second.group, weight.shape[0] // second.group, weight.shape[1], -1).sum(axis=3)
        moved = np.einsum("grj,gj->gr", taps, shift.reshape(second.group, -1)).reshape(-1)
        channels = values.weights[first.index].shape[0]
        values.biases.setdefault(first.index, np.zeros(channels))
        values.biases[first.index] -= shift / first.beta
        values.biases.setdefault(second.index, np.zeros(weight.shape[0]))
        values.biases[second.index] += moved * (second.alpha / second.beta)
        absorbed.append(first.name)
    return absorbed


def _rewrite(
    model: onnx.ModelProto, store: Weights, layers: dict[int, ScaledLayer], values: _Values
) -> onnx.ModelProto:
    """A copy of ``model`` reading the new values under new initializer names."""
    equalized = onnx.ModelProto()
    equalized.CopyFrom(model)
    graph = equalized.graph
    taken = _names(graph)
    position = {tensor.name: i for i, tensor in enumerate(graph.initializer)}
    for index, found in sorted(layers.items()):
        weight = values.weights[index]
        weight = weight.T if found.transposed else weight
        _replace(graph, store, position[found.weight], weight, taken)
        graph.node[index].input[1] = graph.initializer[position[found.weight]].name
        if index not in values.biases:
            continue
        bias_node = graph.node[found.bias_node]
        if found.bias is not None:
            _replace(graph, store, position[found.bias], values.biases[index], taken)
            bias_node.input[found.bias_slot] = graph.initializer[position[found.bias]].name
            continue
        dtype = helper.tensor_dtype_to_np_dtype(graph.initializer[position[found.weight]].data_type)
        name = fresh_name(f"{found.name}/bias", taken)
        graph.initializer.append(numpy_helper.from_array(values.biases[index].astype(dtype), name))
        while len(bias_node.input) <= found.bias_slot:
            bias_node.input.append("")
        bias_node.input[found.bias_slot] = name
    return equalized


def _replace(graph: onnx.GraphProto, store: Weights, position: int, values: np.ndarray, taken: set[str]) -> None:
    """Give the initializer at ``position`` a new name and ``values`` (detached ones go into ``store``)."""
    tensor = graph.initializer[position]
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    tensor.name = fresh_name(f"{tensor.name}/equalized", taken)
    store.replace(tensor, np.ascontiguousarray(values.astype(dtype)))


def _names(graph: onnx.GraphProto) -> set[str]:
    nodes = all_nodes(graph)
    return (
        {tensor.name for tensor in graph.initializer}
        | {value.name for value in (*graph.input, *graph.output, *graph.value_info)}
        | {name for node in nodes for name in (*node.input, *node.output)}
    )
