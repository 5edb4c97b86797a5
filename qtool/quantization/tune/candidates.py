"""Scoring the models ``tune`` builds: SQNR (or the user's metric), size and, when it matters, latency.

The float model's outputs are computed once per sample set and reused by every candidate (see
:class:`qtool.evaluation.scoring.OutputScorer`); the float session used for timing is created once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from qtool.evaluation.metrics import LatencyRun, measure_latency
from qtool.evaluation.scoring import OutputScorer
from qtool.graph.session import create_session
from qtool.graph.weights import Weights
from qtool.quantization.tune.loop import Trial
from qtool.quantization.tune.metric import MetricFunction, score_metric
from qtool.quantization.tune.sensitivity import sqnr_db
from qtool.quantization.tune.space import BLOCK_SIZE


@dataclass(frozen=True)
class Goal:
    """What a model must reach: an SQNR floor, or the user's metric, and optionally a latency bound."""

    target_sqnr_db: float | None = None
    metric: MetricFunction | None = None
    metric_name: str = ""
    target_metric: float | None = None
    lower_is_better: bool = False
    labels: Sequence[Any] | None = None
    max_latency_ratio: float | None = None

    def describe(self) -> str:
        if self.metric is not None:
            return f"{self.metric_name} {'<=' if self.lower_is_better else '>='} {self.target_metric:g}"
        latency = f", latency <= {self.max_latency_ratio:g}x fp32" if self.max_latency_ratio else ""
        return f"SQNR >= {self.target_sqnr_db:g} dB{latency}"

    def accuracy_met(self, sqnr: float, metric: float | None) -> bool:
        if self.metric is not None:
            assert self.target_metric is not None and metric is not None
            return metric <= self.target_metric if self.lower_is_better else metric >= self.target_metric
        assert self.target_sqnr_db is not None
        return sqnr >= self.target_sqnr_db

    def slack_db(self, trial: Trial) -> float | None:
        """How far above (+) or below (-) the SQNR target a trial is; None for a metric goal."""
        if self.metric is not None or self.target_sqnr_db is None:
            return None
        return trial.sqnr_db - self.target_sqnr_db


class Candidates:
    """Measures candidate models against the float model."""

    def __init__(
        self,
        reference: onnx.ModelProto,
        evaluation: OutputScorer,
        weights: Weights,
        source_bytes: int,
        goal: Goal,
        *,
        timed: bool,
        latency_runs: int,
        threads: int | None,
    ) -> None:
        self.evaluation = evaluation
        self.weights = weights
        self.source_bytes = source_bytes
        self.goal = goal
        self.threads = threads
        self.latency_runs = latency_runs
        self._float: ort.InferenceSession | None = None
        if timed:
            self._float = create_session(reference, "the float model", threads=threads, weights=weights)

    @property
    def timed(self) -> bool:
        return self._float is not None

    def verify(self, model: onnx.ModelProto, allocation: dict[str, str], predicted: float) -> Trial:
        """Build ``model``'s session, score it on the evaluation samples and time it when latency matters."""
        session = create_session(model, "a tuning candidate", threads=self.threads, weights=self.weights)
        outputs: list[dict[str, np.ndarray]] | None = [] if self.goal.metric is not None else None
        sqnr = self.evaluation.score_session(session, "a tuning candidate", collect=outputs).worst_db
        metric = None
        if self.goal.metric is not None and outputs is not None:
            references = [self.evaluation.reference_outputs(i) for i in range(len(outputs))]
            metric = score_metric(self.goal.metric, references, outputs, self.goal.labels, self.goal.metric_name)
        size = self.weights.embedded_size(model)
        ratio, interval = None, None
        if self._float is not None:
            _, feed = self.evaluation.samples[0]
            run = LatencyRun(self.latency_runs, warmup=2, threads=self.threads)
            latency = measure_latency(self._float, session, feed, run)
            ratio, interval = latency.ratio, latency.ratio_interval
        note = ""
        meets = self.goal.accuracy_met(sqnr, metric)
        if not meets:
            note = "accuracy below the target"
        elif self.goal.max_latency_ratio is not None and ratio is not None:
            low = interval[0] if interval else ratio
            if low > self.goal.max_latency_ratio:
                meets, note = False, f"slower than {self.goal.max_latency_ratio:g}x fp32"
        return Trial(
            allocation=dict(allocation),
            predicted_db=sqnr_db(predicted),
            size_bytes=size,
            compression=self.source_bytes / size if size else math.inf,
            sqnr_db=sqnr,
            metric=metric,
            latency_ratio=ratio,
            latency_interval=interval,
            meets=meets,
            note=note,
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
