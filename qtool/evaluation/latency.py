"""Interleaved latency timing of a reference and a candidate model, and the paired speed-up with its interval."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Feed
from qtool.evaluation.intervals import median_interval
from qtool.evaluation.providers import GPU_PROVIDERS
from qtool.evaluation.timing import Rounds, time_interleaved
from qtool.schemas.reports.compare import Latency, LatencyStats


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


def latency_record(
    provider: str,
    threads: int | None,
    times: tuple[Sequence[float], Sequence[float]],
    *,
    setup_ms: tuple[float, float] | None = None,
    io_binding: bool = False,
) -> Latency:
    """The report's record of reference and candidate run times (seconds, one per round that ran both).

    The latency ratio is the median of the rounds' own ratios, with its distribution-free interval (see
    :mod:`qtool.evaluation.intervals`); where no round gives one, the medians' ratio. ``setup_ms``: session
    creation and first run of each model (None: not timed); ``io_binding``: inputs and outputs bound on the device.
    """
    reference, candidate = latency_stats(times[0]), latency_stats(times[1])
    ratio, interval = paired_ratio(*times)
    if ratio is not None and ratio > 0:
        speedup = 1 / ratio
    else:
        speedup = reference.median_ms / candidate.median_ms if candidate.median_ms else math.inf
    if ratio is None:
        ratio = candidate.median_ms / reference.median_ms if reference.median_ms else math.inf
    return Latency(
        provider=provider,
        threads=threads,
        reference=reference,
        candidate=candidate,
        speedup=speedup,
        speedup_interval=None if interval is None or min(interval) <= 0 else [1 / interval[1], 1 / interval[0]],
        latency_ratio=ratio if math.isfinite(ratio) else None,
        latency_ratio_interval=list(interval) if interval else None,
        setup_ms=list(setup_ms) if setup_ms else None,
        io_binding=io_binding,
    )


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
) -> Latency:
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
    pair = (times["the reference model"], times["the candidate model"])
    return latency_record(run.provider, run.threads, pair, setup_ms=run.setup_ms, io_binding=bound)
