"""Accuracy-driven fallback: keep the few most sensitive nodes in float until a target SQNR is met.

Some networks (mobile detectors, deep depthwise stacks) amplify quantization
noise so much that a few early layers decide the output's accuracy. The search
here is greedy and deterministic. One per-layer pass measures the SQNR drop each integer node
introduces (:mod:`qtool.evaluation.layers`, the quantization of a node's inputs counted as its own);
given what each move costs in latency (:mod:`qtool.choice.move_costs`), the nodes whose drop is at least
:data:`RANK_SHARE` of the largest are ranked by decibels per millisecond (the cheap moves first: a SiLU,
a residual Add, a small convolution), the others after them by drop. Then the nodes are tried in that order, each
moved to float activations (its weights stay stored quantized) and scored on the
model's outputs only (:mod:`qtool.evaluation.scoring`, float outputs computed once), until the
worst output and its lower confidence bound over those samples both reach the target (the choice
validates on other samples against that bound).
A node whose fallback does not raise the worst output by :data:`MIN_GAIN_DB` is
quantized again. The nodes of If/Loop bodies (which the per-layer pass does not reach) are tried after
the ranked ones, in graph order, each whatever came before it (bodies the data never ran are left alone).
The search stops when the target is met, the node budget is
spent, :data:`PATIENCE` candidates in a row did not help, the target is out of reach
(once a node has helped: the nodes left could not close the gap even if each gained as
much as the best trial so far), or its time is up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import onnx

from qtool.calibration.dataset import Dataset
from qtool.config import QConfig
from qtool.evaluation.layers import Exposure, layer_errors
from qtool.evaluation.scoring import OutputScorer
from qtool.graph.index import all_nodes, node_subgraphs
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.plan.recurrent import RECURRENT_OPS
from qtool.quantization.plan.roles import LOOKUP_OPS
from qtool.schemas.reports.compare import Layer
from qtool.schemas.reports.quantize import SearchStep
from qtool.schemes import CandidateName

PATIENCE = 3  # the search stops after this many candidates in a row that did not help
MoveKind = Literal["float activations", "float"]
"""How the search moves a node: float activations on its stored weight, or not quantized at all."""
FLOAT_ACTIVATIONS: MoveKind = "float activations"  # a moved node computes in float on its stored quantized weight
FLOAT: MoveKind = "float"  # a moved node is not quantized at all (when the weights' rounding alone misses the target)
MIN_GAIN_DB = 0.1  # a node gets float activations only if the worst output gains at least this much
# A node kept entirely float (weights too) grows the file: short of the target, it must buy this many decibels
# times the share of the 8-bit weights' size it adds (1 dB per 10 %: 0.26 dB for a fifth more file is refused;
# a node whose move reaches the target is always kept, the target being the promise)
DB_PER_SIZE = 10.0
# ranked by decibels per millisecond: nodes whose drop is at least this share of the largest (a cheap node that
# adds little error would only spend trials, and a search gives up after PATIENCE of them in a row)
RANK_SHARE = 0.25


@dataclass(frozen=True)
class Moves:
    """How the search moves a node, and what each move costs in latency (ranks the nodes when given)."""

    kind: MoveKind = FLOAT_ACTIVATIONS  # FLOAT_ACTIVATIONS (the node keeps its stored weight) or FLOAT (not quantized)
    costs: Mapping[str, float] | None = None  # estimated milliseconds lost, by node
    costs_from: str = ""  # what the milliseconds were read from, for the report
    # the most milliseconds the kept moves may cost together: past it the placement could no longer run decisively
    # faster than the more accurate one it must beat (storage-only), so a node whose move would cross it is not tried
    budget_ms: float | None = None


@dataclass
class SearchResult:
    """What the sensitivity search measured and which nodes it keeps in float.

    Changed as the search runs; its report (:class:`qtool.schemas.reports.quantize.SearchReport`) is read from it
    under the same names, the properties included.
    """

    target_sqnr_db: float
    max_float_nodes: int
    samples: int  # samples each trial is scored on
    initial_sqnr_db: float
    final_sqnr_db: float
    steps: list[SearchStep] = field(default_factory=list)
    ranked_on_samples: int = 0  # samples of the one per-layer pass that ranked the nodes (0: no pass)
    stopped: str = ""  # why the search ended
    moves: MoveKind = FLOAT_ACTIVATIONS  # what a kept node becomes: FLOAT_ACTIVATIONS or FLOAT
    start: CandidateName = "auto"  # the candidate placement the search started from
    # the lower confidence bound of the final worst output over the search's samples: the search goes on until
    # it reaches the target too, so that the choice's validation on other samples does not miss it by a hair
    final_bound_db: float = -math.inf
    ranked_by: str = "drop"  # "drop", or "dB per ms lost" and what its milliseconds were read from

    def reached_at(self, sqnr: float) -> bool:
        """Whether the search's current worst output ``sqnr`` and its bound both reach the target."""
        return sqnr >= self.target_sqnr_db and self.final_bound_db >= self.target_sqnr_db

    @property
    def kept_nodes(self) -> list[str]:
        """The nodes the search moved, in the order it kept them."""
        return [s.node for s in self.steps if s.kept]

    @property
    def float_activation_nodes(self) -> list[str]:
        """The kept nodes when a move gives float activations (their weights stay quantized), else none."""
        return self.kept_nodes if self.moves == FLOAT_ACTIVATIONS else []

    @property
    def float_nodes(self) -> list[str]:
        """The kept nodes when a move keeps the node entirely float, else none."""
        return self.kept_nodes if self.moves == FLOAT else []

    @property
    def reached(self) -> bool:
        return self.reached_at(self.final_sqnr_db)


@dataclass(frozen=True)
class Candidate:
    """A node the search will try, and the drop the per-layer pass measured for it (None: not measured)."""

    node: str
    op_type: str
    drop_db: float | None


def rank_nodes(rows: list[Layer], movable: set[str], costs: Mapping[str, float] | None = None) -> list[Layer]:
    """The movable nodes that add error (one row per node), in the order the search tries them.

    Without ``costs``: largest drop first. With them (milliseconds by node): the nodes whose drop is at
    least :data:`RANK_SHARE` of the largest by drop per millisecond, then the others by drop.
    """
    best: dict[str, Layer] = {}
    for row in rows:
        if row.node not in movable or row.drop_with_inputs_db <= 0:
            continue
        if row.node not in best or row.drop_with_inputs_db > best[row.node].drop_with_inputs_db:
            best[row.node] = row
    by_drop = sorted(best.values(), key=lambda r: (-r.drop_with_inputs_db, r.position, r.node))
    if not costs or not by_drop:
        return by_drop
    floor = RANK_SHARE * by_drop[0].drop_with_inputs_db
    priced = [r for r in by_drop if r.drop_with_inputs_db >= floor]
    cheapest = min((c for c in (costs.get(r.node, 0.0) for r in priced) if c > 0), default=1.0)

    def per_ms(row: Layer) -> float:  # an unpriced node (no work known) counts as the cheapest
        return row.drop_with_inputs_db / max(costs.get(row.node, 0.0), cheapest)

    ranked = sorted(priced, key=lambda r: (-per_ms(r), -r.drop_with_inputs_db, r.position, r.node))
    return ranked + by_drop[len(priced) :]


def sensitivity_search(
    reference: onnx.ModelProto,
    config: QConfig,
    quantize: Callable[[QConfig], tuple[onnx.ModelProto, set[str]]],
    scorer: OutputScorer,
    ranked: tuple[Dataset, dict[str, int] | None],
    *,
    progress: ProgressFactory | None = None,
    initial: tuple[onnx.ModelProto, set[str], float] | None = None,
    moves: Moves | None = None,
) -> tuple[QConfig, SearchResult | None]:
    """Give float activations to the nodes with the largest SQNR drop until the outputs reach the target.

    Args:
        reference: the prepared float model (tensor names match the quantized one).
        config: the configuration to start from; the result adds the chosen nodes to ``sensitive_nodes``.
            Its ``accuracy`` section sets the target SQNR, the node budget and the time budget.
        quantize: builds the quantized model for a config, and the names of the nodes it may move.
        scorer: scores a model's outputs on the search samples (its threads and weights serve the pass too).
        ranked: the samples of the per-layer pass that ranks the nodes, and the per-sample element counts of
            tensors (they bound its memory).
        progress: receives progress updates.
        initial: ``config``'s model, the nodes it may move and its score, when already measured.
        moves: how a node moves and what each move costs (default: float activations, ranked by drop).

    Returns:
        The config with the chosen nodes in ``sensitive_nodes``, and what was measured
        (None when no node may move: then nothing is measured).
    """
    settings = config.accuracy
    assert settings.target_sqnr_db is not None  # the search runs only toward a target
    moves = moves or Moves()
    model, movable, sqnr = initial if initial is not None else _measured_start(config, quantize, scorer)
    if not movable:  # no node the search may move: nothing to measure
        return config, None
    result = SearchResult(settings.target_sqnr_db, settings.max_float_nodes, len(scorer.samples), sqnr, sqnr)
    result.moves = moves.kind
    if sqnr >= settings.target_sqnr_db:
        result.stopped, result.final_bound_db = "target reached", sqnr  # the start reached it: nothing to refine
        return config, result
    rows = _measured_layers((reference, model), ranked, scorer, movable, progress)
    result.ranked_on_samples = len(ranked[0]) if rows else 0  # (none measured: every movable node is in a body)
    ranking = _ranking(rows, movable, moves, result, model)
    del model
    advance = (progress or noop_progress)("sensitivity", min(len(ranking), settings.max_float_nodes + PATIENCE))
    # the time budget is for the trials: the one per-layer pass that ranks the nodes is what makes them worth it
    prices = (_size_prices(reference) if moves.kind == FLOAT else {}, moves)
    config, sqnr = _try_in_float(config, ranking, quantize, scorer, result, (time.perf_counter(), advance), prices)
    result.final_sqnr_db = sqnr
    return config, result


def _measured_layers(
    models: tuple[onnx.ModelProto, onnx.ModelProto],
    ranked: tuple[Dataset, dict[str, int] | None],
    scorer: OutputScorer,
    movable: set[str],
    progress: ProgressFactory | None,
) -> list[Layer]:
    """The one per-layer pass of the start's model: only the nodes the search may move, and what they read."""
    dataset, elements = ranked
    exposure = Exposure(elements, only=frozenset(movable))
    return layer_errors(
        *models, dataset, threads=scorer.threads, weights=scorer.weights, exposure=exposure, progress=progress
    )


def _ranking(
    rows: list[Layer], movable: set[str], moves: Moves, result: SearchResult, model: onnx.ModelProto
) -> list[Candidate]:
    """The order the nodes are tried in; ``result`` records how they were ranked.

    First :func:`rank_nodes`' order, then the movable nodes the per-layer pass did not measure (inside If/Loop
    bodies) in graph order.
    """
    if moves.costs:
        result.ranked_by = "dB per ms lost" + (f", from {moves.costs_from}" if moves.costs_from else "")
    ranked = [Candidate(r.node, r.op_type, r.drop_with_inputs_db) for r in rank_nodes(rows, movable, moves.costs)]
    measured = {r.node for r in rows}
    unmeasured = [Candidate(n.name, n.op_type, None) for n in all_nodes(model.graph) if n.name in movable - measured]
    return ranked + unmeasured


def _measured_start(
    config: QConfig, quantize: Callable[[QConfig], tuple[onnx.ModelProto, set[str]]], scorer: OutputScorer
) -> tuple[onnx.ModelProto, set[str], float]:
    """``config``'s model, the nodes the search may move in it, and its worst output (scored only when any may)."""
    model, movable = quantize(config)
    return model, movable, scorer.score(model).worst_db if movable else -math.inf


def _try_in_float(
    config: QConfig,
    ranking: list[Candidate],
    quantize: Callable[[QConfig], tuple[onnx.ModelProto, set[str]]],
    scorer: OutputScorer,
    result: SearchResult,
    clock: tuple[float, Callable[[int], None]],
    prices: tuple[dict[str, float], Moves],
) -> tuple[QConfig, float]:
    """Move the ranked nodes to float activations one at a time, keeping each that helps (steps go to ``result``).

    ``clock``: when the trials started, and the progress to advance. ``prices``: by node, the gain in decibels a
    node kept entirely float must buy when it does not reach the target, and the moves (their milliseconds and the
    budget they share).
    """
    started, advance = clock
    price, moves = prices
    costs, budget = moves.costs or {}, moves.budget_ms
    spent, over_budget = 0.0, 0
    sqnr, seconds = result.initial_sqnr_db, config.accuracy.search_seconds
    target = result.target_sqnr_db
    rejected_in_a_row, best_gain = 0, -math.inf
    result.stopped = "no node left to try"
    for candidate in ranking:
        # a node the per-layer pass did not measure (in a body) is tried whatever came before: no ranking put it last
        measured = candidate.drop_db is not None
        patience = rejected_in_a_row if measured else 0
        stop = _stop_reason(result, sqnr, patience, time.perf_counter() - started, seconds, best_gain)
        if stop:
            result.stopped = stop
            break
        cost = costs.get(candidate.node)
        if budget is not None and spent + (cost or 0.0) > budget:
            over_budget += 1  # kept, its move would leave the placement no faster than the one it must beat
            continue
        trial = _moved(config, candidate.node, result.moves)
        trial_model, _ = quantize(trial)
        score = scorer.score(trial_model)
        del trial_model
        best_gain = max(best_gain, score.worst_db - sqnr)
        needed = MIN_GAIN_DB if score.worst_db >= target else max(MIN_GAIN_DB, price.get(candidate.node, 0.0))
        kept = score.worst_db >= sqnr + needed
        result.steps.append(_step(candidate, score.worst_db, kept, cost))
        if kept:
            config, sqnr, spent = trial, score.worst_db, spent + (cost or 0.0)
            result.final_bound_db = score.worst_bound_db()
        rejected_in_a_row = 0 if kept else rejected_in_a_row + measured
        advance(1)
    else:
        if result.reached_at(sqnr):
            result.stopped = "the last node tried reached it"
        elif over_budget and budget is not None:
            result.stopped = (
                f"no faster placement left: {over_budget} node{'s' if over_budget > 1 else ''} not tried, each "
                f"costing more than the {max(budget - spent, 0.0):.2f} ms the placement may lose and still beat "
                "storage-only"
            )
    return config, sqnr


def _step(candidate: Candidate, sqnr: float, kept: bool, cost: float | None) -> SearchStep:
    node, op_type, drop_db = candidate.node, candidate.op_type, candidate.drop_db
    return SearchStep(node=node, op_type=op_type, drop_db=drop_db, sqnr_db=sqnr, kept=kept, cost_ms=cost)


def _size_prices(reference: onnx.ModelProto) -> dict[str, float]:
    """By node (bodies' too), :data:`DB_PER_SIZE` times the share its float weight adds to the model's 8-bit weights."""
    graphs = [reference.graph, *(body for node in all_nodes(reference.graph) for body in node_subgraphs(node))]
    sizes = {i.name: math.prod(i.dims) for graph in graphs for i in graph.initializer}
    stored = sum(sizes.values()) or 1  # an 8-bit byte per value
    prices = {}
    for node in all_nodes(reference.graph):
        # a recurrent node's W and R, a lookup's table, the weight input of Conv, Gemm, MatMul
        weights = (
            node.input[1:3]
            if node.op_type in RECURRENT_OPS
            else node.input[:1]
            if node.op_type in LOOKUP_OPS
            else node.input[1:2]
        )
        own = sum(sizes.get(name, 0) for name in weights)
        prices[node.name] = DB_PER_SIZE * 3 * own / stored  # float32: 3 bytes more per value
    return prices


def _moved(config: QConfig, node: str, moves: MoveKind) -> QConfig:
    """``config`` with ``node`` moved as the search moves nodes."""
    if moves == FLOAT:
        return replace(config, float_nodes=config.float_nodes | {node})
    return replace(config, sensitive_nodes=config.sensitive_nodes | {node})


def _stop_reason(
    result: SearchResult, sqnr: float, rejected_in_a_row: int, elapsed: float, seconds: float, best_gain: float
) -> str:
    """Why the search stops before its next node ("" to go on)."""
    if result.reached_at(sqnr):
        return "target reached (its lower confidence bound too)"
    left = result.max_float_nodes - len(result.kept_nodes)
    if left <= 0:
        return f"{result.max_float_nodes} nodes in float (accuracy.max_float_nodes)"
    # Judged once a node has helped: before, a gain of 0 may only mean another node masks it.
    if result.kept_nodes and sqnr + left * max(best_gain, 0.0) < result.target_sqnr_db:
        return (
            f"out of reach: the best trial gained {max(best_gain, 0.0):.2f} dB, and {left} more node"
            f"{'s' if left > 1 else ''} at that rate would not close the {result.target_sqnr_db - sqnr:.2f} dB gap"
        )
    if rejected_in_a_row >= PATIENCE:
        return f"{PATIENCE} nodes in a row did not help"
    if elapsed > seconds:
        return f"time is up ({seconds:.1f} s of trials)"
    return ""
