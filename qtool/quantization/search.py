"""Accuracy-driven fallback: keep the few most sensitive nodes in float until a target SQNR is met.

Some networks (mobile detectors, deep depthwise stacks) amplify quantization
noise so much that a few early layers decide the output's accuracy. The search
here is greedy and deterministic: quantize, measure every layer's SQNR drop on a
few samples (:mod:`qtool.evaluation.layers`, the quantization of a node's inputs counted
as its own), move the integer node with the largest drop
to float activations (its weights stay stored quantized), and repeat until the model's worst output reaches the target
SQNR, the node budget is spent, or two candidates in a row did not help. A
node whose fallback does not improve the output is quantized again and not
tried again, so every node given float activations pays for itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import onnx

from qtool.calibration.dataset import Dataset
from qtool.config import QConfig
from qtool.evaluation.layers import LayerError, layer_errors
from qtool.graph.weights import Weights

PATIENCE = 2  # the search stops after this many candidates in a row that did not help
MIN_GAIN_DB = 0.1  # a node gets float activations only if the worst output gains at least this much


@dataclass(frozen=True)
class FallbackStep:
    """One node the search tried in float, and what it did to the output."""

    node: str
    op_type: str
    drop_db: float  # the SQNR drop that made it the candidate, its input quantization included
    sqnr_db: float  # the worst output's SQNR with it in float
    kept: bool  # False: no gain, the node was quantized again


@dataclass
class FallbackResult:
    """What the sensitivity search measured and which nodes it keeps in float."""

    target_sqnr_db: float
    max_nodes: int
    samples: int
    initial_sqnr_db: float
    final_sqnr_db: float
    steps: list[FallbackStep] = field(default_factory=list)

    @property
    def float_nodes(self) -> list[str]:
        return [s.node for s in self.steps if s.kept]

    @property
    def reached(self) -> bool:
        return self.final_sqnr_db >= self.target_sqnr_db


def output_sqnr(rows: list[LayerError], outputs: list[str]) -> float:
    """The worst SQNR among the graph outputs (-inf when none was measured)."""
    values = [r.sqnr_db for r in rows if r.tensor in outputs]
    return min(values) if values else -math.inf


def search_fallback(
    reference: onnx.ModelProto,
    config: QConfig,
    quantize: Callable[[QConfig], tuple[onnx.ModelProto, set[str]]],
    dataset: Dataset,
    *,
    target_sqnr_db: float,
    max_nodes: int,
    threads: int | None = None,
    on_round: Callable[[int], None] | None = None,
    weights: Weights | None = None,
) -> tuple[QConfig, FallbackResult | None]:
    """Give float activations to the nodes with the largest SQNR drop until the outputs reach the target.

    Args:
        reference: the prepared float model (tensor names match the quantized one).
        config: the configuration to start from; the result adds the chosen nodes to ``sensitive_nodes``.
        quantize: builds the quantized model for a config, and the names of the nodes it quantized.
        dataset: the samples measured each round.
        target_sqnr_db: stop once the worst output's SQNR reaches this.
        max_nodes: at most this many nodes are kept in float.
        threads: onnxruntime intra-op threads for the measurements (None: its default).
        on_round: called once per measured round.
        weights: the detached values the models use (see :mod:`qtool.graph.weights`).

    Returns:
        The config with the chosen nodes in ``sensitive_nodes``, and what was measured
        (None when no node may move: then nothing is measured).
    """
    outputs = [o.name for o in reference.graph.output]

    def measure(model: onnx.ModelProto) -> tuple[float, list[LayerError]]:
        rows = layer_errors(reference, model, dataset, threads=threads, weights=weights)
        if on_round:
            on_round(1)
        return output_sqnr(rows, outputs), rows

    model, quantized = quantize(config)
    if not quantized:  # no node the search may move: nothing to measure
        return config, None
    sqnr, rows = measure(model)
    result = FallbackResult(target_sqnr_db, max_nodes, len(dataset), sqnr, sqnr)
    tried: set[str] = set()
    rejected_in_a_row = 0
    while sqnr < target_sqnr_db and len(result.float_nodes) < max_nodes and rejected_in_a_row < PATIENCE:
        candidates = [r for r in rows if r.node in quantized and r.node not in tried and r.drop_with_inputs_db > 0]
        if not candidates:
            break
        worst = max(candidates, key=lambda r: (r.drop_with_inputs_db, -r.position))
        tried.add(worst.node)
        trial = replace(config, sensitive_nodes=config.sensitive_nodes | {worst.node})
        trial_model, trial_quantized = quantize(trial)
        trial_sqnr, trial_rows = measure(trial_model)
        kept = trial_sqnr >= sqnr + MIN_GAIN_DB
        result.steps.append(FallbackStep(worst.node, worst.op_type, worst.drop_with_inputs_db, trial_sqnr, kept))
        if kept:
            config, sqnr, rows, quantized = trial, trial_sqnr, trial_rows, trial_quantized
        rejected_in_a_row = 0 if kept else rejected_in_a_row + 1
    result.final_sqnr_db = sqnr
    return config, result
