"""AWQ (Lin et al., 2023): per-input-channel scales ``s = mean|x|^alpha`` moved into weight-only weights.

For ``Y = X W`` (``W [K, N]`` quantized blockwise along K) the error a weight row adds to ``Y``
is its rounding error times its input: rows read by large activations matter most. Multiplying
row ``k`` by ``s_k > 1`` and dividing input channel ``k`` by it leaves ``Y`` unchanged in exact
arithmetic, but makes that row a larger share of its block's range, so it is rounded with a
smaller relative error. :func:`channel_scales` gives ``s`` for one ``alpha``; :func:`awq_readers`
finds the nodes to scale, :class:`InputMoments` measures their inputs in a float pass,
:func:`choose_awq_scales` searches ``alpha`` and :func:`apply_awq` edits the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from qtool.graph.index import GraphView
from qtool.graph.weights import Weights
from qtool.numerics.qparams import dequantize, quantize
from qtool.numerics.ranges import weight_qparams
from qtool.quantization.algorithms.transforms.channel_taps import TensorTap
from qtool.quantization.algorithms.transforms.smoothing import SmoothingReport, smooth
from qtool.quantization.plan.records import QuantPlan
from qtool.schemes import TensorScheme

MEAN_FLOOR = 1e-4  # channels quieter than this fraction of the loudest are treated as this loud
AWQ_MAX_K = 4096  # a [K, K] second moment per input tensor: 128 MiB at K = 4096
AWQ_MAX_ROWS = 32768  # calibration rows (tokens) per tensor: enough for a K x K moment, bounded cost
AWQ_BUDGET_BYTES = 1 << 30  # all second moments together
AWQ_GRID = 20  # alphas tried: 0, 0.05, ... 0.95
AWQ_CHUNK_ELEMENTS = 1 << 22  # weight elements a trial's error is computed on at once (float64: 32 MB)


def channel_scales(input_mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """``mean|x|^alpha`` normalised so that its largest and smallest entries multiply to 1: float32 [K]."""
    mean = np.asarray(input_mean_abs, np.float64)
    top = mean.max(initial=0.0)
    if top <= 0:
        return np.ones(mean.shape, np.float32)
    powered = np.maximum(mean, MEAN_FLOOR * top) ** alpha
    return (powered / np.sqrt(powered.max() * powered.min())).astype(np.float32)


@dataclass
class InputMoments(TensorTap):
    """A float-pass tap: mean |x| and ``E[x x^T]`` over the last axis of the tensors AWQ scales."""

    mean_abs: dict[str, np.ndarray] = field(default_factory=dict)
    second: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, value: np.ndarray) -> None:
        """Add this batch's rows of ``name`` to its sums, up to :data:`AWQ_MAX_ROWS` rows in all."""
        seen = self.rows.get(name, 0)
        if seen >= AWQ_MAX_ROWS or value.ndim == 0:
            return
        rows = value.reshape(-1, value.shape[-1]).astype(np.float64)[: AWQ_MAX_ROWS - seen]
        if name not in self.second:
            self.mean_abs[name] = np.zeros(rows.shape[1])
            self.second[name] = np.zeros((rows.shape[1], rows.shape[1]))
        self.mean_abs[name] += np.abs(rows).sum(axis=0)
        self.second[name] += rows.T @ rows
        self.rows[name] = seen + rows.shape[0]

    def moments(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(mean |x| [K], E[x x^T] [K, K]) of ``name`` (None: never observed)."""
        n = self.rows.get(name, 0)
        return (self.mean_abs[name] / n, self.second[name] / n) if n else None


@dataclass(frozen=True)
class AwqReader:
    """A weight-only MatMul/Gemm AWQ may scale: its activation, weight as [K, N] and quantization grid."""

    node: str
    tensor: str
    weight: np.ndarray  # float [K, N]
    scheme: TensorScheme  # how the weight is stored
    block_size: int | None  # blocks along K, or None: one scale per output column


def awq_readers(plan: QuantPlan, model: onnx.ModelProto, store: Weights) -> tuple[list[AwqReader], dict[str, str]]:
    """The plan's nodes that turn AWQ on and run weight-only, and why the others cannot be scaled."""
    nodes = GraphView(model).by_name
    inits = {i.name: i for i in model.graph.initializer}
    readers: list[AwqReader] = []
    skipped: dict[str, str] = {}
    for p in plan.nodes:
        if not p.scheme.algorithms.awq:
            continue
        node = nodes[p.name]
        if p.placement != "weight_only" or p.scheme.weight.fp16 or p.weight is None:
            skipped[p.name] = "awq: applies to weight-only 4/2/8-bit weights (float activations)"
            continue
        if p.op_type not in ("MatMul", "Gemm") or node.input[1] != p.weight.name:
            skipped[p.name] = "awq: applies to MatMul/Gemm with a constant second input"
            continue
        values = store.value(inits[p.weight.name])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if values.ndim != 2 or attrs.get("transA", 0):
            skipped[p.name] = "awq: needs a 2-D weight read without transA"
            continue
        matrix = values.T if attrs.get("transB", 0) else values
        if matrix.shape[0] > AWQ_MAX_K:
            skipped[p.name] = f"awq: K = {matrix.shape[0]} is over {AWQ_MAX_K}"
            continue
        block = p.weight.block_size if p.weight.axis == (1 if attrs.get("transB", 0) else 0) else None
        readers.append(AwqReader(p.name, node.input[0], matrix, p.scheme.weight, block))
    return readers, skipped


def within_budget(readers: list[AwqReader]) -> tuple[list[AwqReader], list[AwqReader]]:
    """The readers whose inputs' second moments fit :data:`AWQ_BUDGET_BYTES` together (in graph order), and the rest."""
    sizes: dict[str, int] = {}
    for reader in readers:
        sizes.setdefault(reader.tensor, reader.weight.shape[0] ** 2 * 8)
    kept, total = set(), 0
    for tensor, size in sizes.items():
        if total + size <= AWQ_BUDGET_BYTES:
            kept.add(tensor)
            total += size
    return [r for r in readers if r.tensor in kept], [r for r in readers if r.tensor not in kept]


def choose_awq_scales(
    readers: list[AwqReader], moments: InputMoments
) -> tuple[dict[str, tuple[np.ndarray, float]], dict[str, str]]:
    """AWQ's scales per activation tensor, shared by its readers (weights concatenated along N)."""
    groups: dict[str, list[AwqReader]] = {}
    for reader in readers:
        groups.setdefault(reader.tensor, []).append(reader)
    chosen: dict[str, tuple[np.ndarray, float]] = {}
    skipped: dict[str, str] = {}
    for tensor, group in groups.items():
        observed = moments.moments(tensor)
        k = group[0].weight.shape[0]
        if observed is None or observed[0].shape != (k,):
            skipped[tensor] = "awq: its activation was not observed"
            continue
        mean_abs, second = observed
        first = group[0]
        chosen[tensor] = _awq_search(
            [r.weight for r in group], mean_abs, second, first.scheme, first.block_size, tensor
        )
    return chosen, skipped


def _awq_search(
    weights: list[np.ndarray],
    mean_abs: np.ndarray,
    second: np.ndarray,
    scheme: TensorScheme,
    block: int | None,
    what: str,
) -> tuple[np.ndarray, float]:
    """AWQ's scales for the readers' ``weights [K, N_i]``: ``mean|x|^alpha`` with the alpha of least output error.

    The error of each trial is measured on the grid the weight will really be stored on (qtool's
    weight qparams, per block along K or per column) and weighed by the input's second moment:
    ``tr(E^T E[x x^T] E)`` with ``E = Q(W s) / s - W`` is the mean squared output error over the
    calibration tokens, exactly. ``alpha = 0`` (no scaling) is among the trials. The weights are
    taken side by side; past :data:`AWQ_CHUNK_ELEMENTS` a few columns at a time (each column's error
    is its own), so that a trial's float64 temporaries stay small whatever the layer's size.
    """
    if sum(weight.size for weight in weights) <= AWQ_CHUNK_ELEMENTS:
        columns = [np.concatenate(weights, axis=1)]
    else:
        step = max(1, AWQ_CHUNK_ELEMENTS // max(1, weights[0].shape[0]))
        columns = [weight[:, start : start + step] for weight in weights for start in range(0, weight.shape[1], step)]
    losses = []
    for trial in range(AWQ_GRID):
        s = channel_scales(mean_abs, trial / AWQ_GRID).astype(np.float64)[:, None]
        losses.append(sum(_awq_loss(part, s, second, scheme, block, what) for part in columns))
    best = int(np.argmin(losses))
    return channel_scales(mean_abs, best / AWQ_GRID), best / AWQ_GRID


def _awq_loss(
    weight: np.ndarray, s: np.ndarray, second: np.ndarray, scheme: TensorScheme, block: int | None, what: str
) -> float:
    """The output error of ``weight`` scaled by ``s`` on its storage grid, weighed by the input's second moment."""
    scaled = (weight * s).astype(np.float32)
    qp = weight_qparams(scaled, scheme, 0 if block else 1, f"weight read by {what}", block)
    error = dequantize(quantize(scaled, qp), qp).astype(np.float64) / s - weight
    return float(np.sum((second @ error) * error))


def apply_awq(
    model: onnx.ModelProto, store: Weights, readers: list[AwqReader], scales: dict[str, tuple[np.ndarray, float]]
) -> tuple[onnx.ModelProto, SmoothingReport]:
    """``model`` with AWQ's scales moved into the readers' weights (``1/s`` folded into the producer or a Mul)."""
    maxima = {tensor: np.ones_like(s) for tensor, (s, _) in scales.items()}  # shapes only: the scales are given
    return smooth(model, store, maxima, frozenset(r.node for r in readers), scales=scales)
