"""Scoring the models ``tune`` builds: SQNR (or the user's metric), size and, when it matters, latency.

Candidates are selected on one part of the evaluation samples and the chosen one is validated on
the other part, which no choice ever saw (see :mod:`qtool.choice.tune.split`). Both judge the
lower confidence bound of the figure, not the figure itself. The float model's outputs are computed
once per sample set and reused by every candidate (see :class:`qtool.evaluation.scoring.OutputScorer`);
the float session used for timing is created once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from qtool.choice.decode import DecodeJudge
from qtool.choice.tune.loop import Trial
from qtool.choice.tune.metric import MetricFunction, score_metric
from qtool.choice.tune.sensitivity import sqnr_db
from qtool.choice.tune.space import BLOCK_SIZE
from qtool.choice.validated import Validation
from qtool.evaluation.confidence import CONFIDENCE, mean_bound
from qtool.evaluation.latency import LatencyRun, measure_latency
from qtool.evaluation.scoring import OutputScorer, signal_means
from qtool.graph.session import create_session
from qtool.graph.weights import Weights


@dataclass(frozen=True)
class Goal:
    """What a model must reach (an SQNR floor, the user's metric or a decoder's agreement), and a latency bound.

    Accuracy is judged on the lower confidence bound of the figure (see
    :mod:`qtool.evaluation.confidence`), plus ``margin_db`` while selecting: the margin the
    validation taught, in the goal's units (dB, or the metric's).
    ``decode_steps``: the figure is the mean free-running agreement of a greedy decode of that many
    steps per sample (:mod:`qtool.evaluation.language_model`), which must reach ``target_metric``.
    """

    target_sqnr_db: float | None = None
    metric: MetricFunction | None = None
    metric_name: str = ""
    target_metric: float | None = None
    lower_is_better: bool = False
    labels: Sequence[Any] | None = None
    max_latency_ratio: float | None = None
    confidence: float = CONFIDENCE
    margin_db: float = 0.0
    decode_steps: int | None = None

    @property
    def by_metric(self) -> bool:
        """Whether a per-sample figure (the user's metric, or decode agreement) is judged instead of SQNR."""
        return self.metric is not None or self.decode_steps is not None

    def describe(self) -> str:
        if self.by_metric:
            return f"{self.metric_name} {'<=' if self.lower_is_better else '>='} {self.target_metric:g}"
        latency = f", latency <= {self.max_latency_ratio:g}x fp32" if self.max_latency_ratio else ""
        return f"SQNR >= {self.target_sqnr_db:g} dB{latency}"

    def accuracy_met(self, bound_db: float, metric_bound: float | None, *, margin: bool = True) -> bool:
        """Whether the bounds reach the target (with the selection margin unless ``margin`` is False)."""
        if self.by_metric:
            assert self.target_metric is not None and metric_bound is not None
            extra = self.margin_db if margin else 0.0
            if self.lower_is_better:
                return metric_bound <= self.target_metric - extra
            if self.decode_steps is not None:  # an agreement: a margin past 1 would rule out even exact models
                return metric_bound >= min(1.0, self.target_metric + extra)
            return metric_bound >= self.target_metric + extra
        assert self.target_sqnr_db is not None
        return bound_db >= self.target_sqnr_db + (self.margin_db if margin else 0.0)

    def shortfall(self, bound_db: float, metric_bound: float | None) -> float:
        """How far a bound falls short of the target, in the goal's units (0 when it reaches it)."""
        if self.by_metric:
            assert self.target_metric is not None and metric_bound is not None
            short = metric_bound - self.target_metric if self.lower_is_better else self.target_metric - metric_bound
        else:
            assert self.target_sqnr_db is not None
            short = self.target_sqnr_db - bound_db
        return max(0.0, short) if math.isfinite(short) else 0.0

    def slack_db(self, trial: Trial) -> float | None:
        """How far a trial's bound is above (+) or below (-) the SQNR target and margin; None for a metric goal."""
        if self.by_metric or self.target_sqnr_db is None:
            return None
        return trial.bound_db - self.target_sqnr_db - self.margin_db


@dataclass(frozen=True)
class Halves:
    """The evaluation samples in two: the selection chooses, the validation checks the choice."""

    selection: OutputScorer
    validation: OutputScorer
    labels: tuple[Sequence[Any] | None, Sequence[Any] | None] = (None, None)  # per sample of each half
    decode: tuple[DecodeJudge, DecodeJudge] | None = None  # a decode goal's float greedy decodes of each half
    validation_files: Sequence[str] | None = None  # the EVAL files the validation scorer stands for
    validations: int = 1  # choices validated at most: each bound at a confidence that holds for them all


class Candidates:
    """Measures candidate models against the float model: selection on one set, validation on another."""

    def __init__(
        self,
        reference: onnx.ModelProto,
        halves: Halves,
        weights: Weights,
        source_bytes: int,
        goal: Goal,
        *,
        timed: bool,
        latency_runs: int,
        threads: int | None,
    ) -> None:
        selection, validation = self.selection, self.validation = halves.selection, halves.validation
        validation_files, validations = halves.validation_files, halves.validations
        # the EVAL files the validation scorer stands for (a decoder's also scores the decode step after each)
        self.validation_files = list(validation_files) if validation_files is not None else list(validation.files)
        self.weights = weights
        self.source_bytes = source_bytes
        self.goal = goal
        self.threads = threads
        self.latency_runs = latency_runs
        self.labels = halves.labels  # per sample of the selection and of the validation set
        self.decode = halves.decode  # a decode goal's float greedy decodes of the selection and of the validation set
        # up to ``validations`` choices are validated: each bound at a confidence that holds for them all (Bonferroni)
        self.validation_confidence = 1.0 - (1.0 - goal.confidence) / max(1, validations)
        self.signal = signal_means([selection, validation])  # the float outputs' energy over all of EVAL
        self.slowest = 0.0  # seconds of the slowest verification so far
        self._float: ort.InferenceSession | None = None
        if timed:
            self._float = create_session(reference, "the float model", threads=threads, weights=weights)

    @property
    def timed(self) -> bool:
        return self._float is not None

    def _accuracy(
        self,
        scorer: OutputScorer,
        session: ort.InferenceSession,
        labels: Sequence[Any] | None,
        confidence: float,
        decode: DecodeJudge | None,
    ) -> tuple[float, float, float | None, float | None]:
        """(pooled SQNR, its bound, mean metric, its bound) of ``session`` on ``scorer``'s samples.

        A decode goal's metric is the mean free-running agreement of ``decode``'s samples (the token
        files, without the decode-step samples the scorer adds to them).
        """
        outputs: list[dict[str, np.ndarray]] | None = [] if self.goal.metric is not None else None
        score = scorer.score_session(session, "a tuning candidate", collect=outputs)
        values: list[float] | None = None
        if self.goal.metric is not None and outputs is not None:
            references = [scorer.reference_outputs(i) for i in range(len(outputs))]
            values = score_metric(self.goal.metric, references, outputs, labels, self.goal.metric_name)
        elif decode is not None:
            values = list(decode.score(session, forced=False).free_running_by_sample)
        metric = bound = None
        if values is not None:
            metric = float(np.mean(values)) if values else math.nan
            bound = mean_bound(values, confidence, lower_is_better=self.goal.lower_is_better)
        return score.worst_db, score.worst_bound_db(confidence, self.signal), metric, bound

    def verify(self, model: onnx.ModelProto, allocation: dict[str, str], predicted: float) -> Trial:
        """Build ``model``'s session, score it on the selection samples and time it when latency matters."""
        started = time.monotonic()
        session = create_session(model, "a tuning candidate", threads=self.threads, weights=self.weights)
        judge = self.decode[0] if self.decode else None
        sqnr, bound, metric, metric_bound = self._accuracy(
            self.selection, session, self.labels[0], self.goal.confidence, judge
        )
        size = self.weights.embedded_size(model)
        ratio, interval = None, None
        if self._float is not None:
            _, feed = self.selection.samples[0]
            run = LatencyRun(self.latency_runs, warmup=2, threads=self.threads)
            latency = measure_latency(self._float, session, feed, run)
            ratio, bounds = latency.latency_ratio, latency.latency_ratio_interval
            interval = (bounds[0], bounds[1]) if bounds else None
        trial = Trial(
            allocation=dict(allocation),
            predicted_sqnr_db=sqnr_db(predicted),
            size_bytes=size,
            compression_ratio=self.source_bytes / size if size else math.inf,
            sqnr_db=sqnr,
            bound_db=bound,
            metric=metric,
            metric_bound=metric_bound,
            latency_ratio=ratio,
            latency_ratio_interval=interval,
        )
        self.slowest = max(self.slowest, time.monotonic() - started)
        return self.judged(trial)

    def judged(self, trial: Trial) -> Trial:
        """``trial`` with its verdict under the current goal (and margin)."""
        meets, note = True, ""
        if all(option == "float" for option in trial.allocation.values()):
            meets, note = False, "nothing quantized"
        elif not self.goal.accuracy_met(trial.bound_db, trial.metric_bound):
            meets, note = False, "accuracy below the target" + (" and margin" if self.goal.margin_db > 0 else "")
        elif self.goal.max_latency_ratio is not None and trial.latency_ratio is not None:
            low = trial.latency_ratio_interval[0] if trial.latency_ratio_interval else trial.latency_ratio
            if low > self.goal.max_latency_ratio:
                meets, note = False, f"slower than {self.goal.max_latency_ratio:g}x fp32"
        return replace(trial, meets=meets, note=note)

    def validate(self, model: onnx.ModelProto) -> Validation:
        """Score ``model`` on the validation samples (the promise: its bound, no margin)."""
        session = create_session(model, "a validated candidate", threads=self.threads, weights=self.weights)
        judge = self.decode[1] if self.decode else None
        sqnr, bound, metric, metric_bound = self._accuracy(
            self.validation, session, self.labels[1], self.validation_confidence, judge
        )
        return Validation(
            samples=list(self.validation_files),
            sqnr_db=sqnr,
            bound_db=bound,
            metric=metric,
            metric_bound=metric_bound,
            meets=self.goal.accuracy_met(bound, metric_bound, margin=False),
        )


def node_costs(
    nodes: Sequence[str],
    shapes: dict[str, list[int]],
    channel_axes: dict[str, int | None],
    block_axes: dict[str, int | None],
    work: dict[str, int],
    objective: str,
    options: Sequence[str],
    integer: Callable[[str], bool],
) -> dict[str, dict[str, float]]:
    """Predicted cost of each option per node: stored bytes (``size``) or time in MAC units (``latency``).

    A per-block weight stores a float scale per block of 32 along its reduction axis; where that axis
    is short (a depthwise convolution's is 1) the scales outweigh the weights, and the cost says so.
    """
    costs: dict[str, dict[str, float]] = {}
    for node in nodes:
        shape = shapes[node]
        elements = int(np.prod(shape))
        axis = channel_axes.get(node)
        channels = shape[axis] if axis is not None and shape else 1
        block_axis = block_axes.get(node)
        reduction = shape[block_axis] if block_axis is not None and shape else elements
        blocks = elements // max(reduction, 1) * -(-reduction // BLOCK_SIZE)
        stored = {
            "float": 4.0 * elements,
            "fp16": 2.0 * elements,
            "w8": elements + 4.0 * channels,
            "w8a8": elements + 4.0 * channels,
            "w8a16": elements + 4.0 * channels,
            "w8b": elements + 4.0 * blocks,
            "w8bg": elements + 4.0 * blocks,
            "w8g": elements + 4.0 * channels,
            "w4": elements / 2 + 4.0 * blocks,
            "w4g": elements / 2 + 4.0 * blocks,
            "w2": elements / 4 + 4.0 * blocks,
        }
        if objective == "latency":
            macs = float(work.get(node) or elements)
            costs[node] = {o: macs * (0.5 if integer(o) else 1.0) + 1e-3 * stored[o] for o in options}
        else:
            costs[node] = {o: stored[o] for o in options}
    return costs
