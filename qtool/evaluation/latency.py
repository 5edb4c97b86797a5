"""Interleaved latency timing of a reference and a candidate model, and the paired speed-up with its interval."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Feed
from qtool.evaluation.intervals import median_interval
from qtool.evaluation.providers import GPU_PROVIDERS
from qtool.evaluation.timing import Rounds, time_interleaved
from qtool.schemas.reports.compare import LatencyStats


def latency_stats(seconds: Sequence[float]) -> LatencyStats:
    """The report's latency record of one model's run times."""
    ms = np.asarray(seconds) * 1e3
    return LatencyStats(
        median_ms=float(np.median(ms)),
        p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)),
        mean_ms=float(ms.mean()),
        runs=len(seconds),
    )


@dataclass(frozen=True)
class LatencyComparison:
    """Interleaved latency of reference and candidate on one execution provider."""

    provider: str
    threads: int | None
    reference: LatencyStats
    candidate: LatencyStats
    # session creation + first run (TensorRT builds its engines then), reference and candidate; None: not timed
    setup_ms: tuple[float, float] | None = None
    io_binding: bool = False  # inputs and outputs bound on the device (GPU providers): no host copies timed
    # the candidate run on this provider against the float reference (on CPU): worst output SQNR over
    # the evaluation samples; None on the CPU, whose accuracy is the report's main table
    candidate_sqnr_db: float | None = None
    # candidate/reference time, the median over rounds of each round's own ratio (both models ran in it),
    # and its distribution-free interval (see qtool.evaluation.intervals); None: not enough rounds
    ratio: float | None = None
    ratio_interval: tuple[float, float] | None = None
    speedup: float = field(init=False)

    def __post_init__(self) -> None:
        if self.ratio is not None and self.ratio > 0:
            speedup = 1 / self.ratio
        else:
            speedup = self.reference.median_ms / self.candidate.median_ms if self.candidate.median_ms else math.inf
        object.__setattr__(self, "speedup", speedup)

    @property
    def latency_ratio(self) -> float:
        """Candidate time over reference time (the paired median where measured)."""
        if self.ratio is not None:
            return self.ratio
        return self.candidate.median_ms / self.reference.median_ms if self.reference.median_ms else math.inf

    @property
    def speedup_interval(self) -> tuple[float, float] | None:
        """The interval of the speed-up (reference over candidate time)."""
        if self.ratio_interval is None or min(self.ratio_interval) <= 0:
            return None
        return 1 / self.ratio_interval[1], 1 / self.ratio_interval[0]


def paired_ratio(
    reference: Sequence[float], candidate: Sequence[float]
) -> tuple[float | None, tuple[float, float] | None]:
    """Median of the per-round ratios candidate/reference, and its confidence interval."""
    ratios = [c / r for r, c in zip(reference, candidate, strict=True) if r > 0]
    if not ratios:
        return None, None
    return float(np.median(ratios)), median_interval(ratios)


LATENCY_BLOCK_SECONDS = 0.005  # each timed sample: back-to-back runs lasting about this long, averaged


@dataclass(frozen=True)
class LatencyRun:
    """How one latency comparison runs and what it reports beside the times."""

    runs: int  # timed rounds
    warmup: int  # untimed runs of each model first
    threads: int | None  # the sessions' intra-op threads (reported)
    provider: str = "CPUExecutionProvider"
    setup_ms: tuple[float, float] | None = None  # session creation and first run of each model (reported)


def measure_latency(
    reference: ort.InferenceSession,
    candidate: ort.InferenceSession,
    feed: Feed,
    run: LatencyRun,
    on_progress: Callable[[int], None] | None = None,
) -> LatencyComparison:
    """Time both sessions on ``feed``: warm-up runs, then ``run.runs`` timed rounds interleaved.

    Interleaving (see :func:`qtool.evaluation.timing.time_interleaved`) makes machine noise
    (frequency changes, other processes) hit both models alike. On a GPU provider the inputs and
    outputs are bound on the device, so the time is the model's, not the host copies'.
    """
    device = "cuda" if run.provider in GPU_PROVIDERS else None
    times, bound = time_interleaved(
        {"the reference model": reference, "the candidate model": candidate},
        feed,
        Rounds(run.runs, minimum=run.runs, warmup=run.warmup, block_seconds=LATENCY_BLOCK_SECONDS),
        on_round=on_progress,
        device=device,
    )
    ref_times, cand_times = times["the reference model"], times["the candidate model"]
    ratio, interval = paired_ratio(ref_times, cand_times)
    return LatencyComparison(
        run.provider,
        run.threads,
        latency_stats(ref_times),
        latency_stats(cand_times),
        run.setup_ms,
        bound,
        ratio=ratio,
        ratio_interval=interval,
    )
