"""Latency of a candidate against its reference on each provider, and a second look at a failed latency gate."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from qtool.calibration.dataset import Dataset
from qtool.errors import QtoolError
from qtool.evaluation.gates import Gate
from qtool.evaluation.latency import LatencyRun, measure_latency
from qtool.evaluation.providers import session_providers, unavailable_reason
from qtool.graph.session import create_session, run_session
from qtool.options import EvaluationOptions
from qtool.progress import ProgressFactory
from qtool.schemas.reports.compare import GateResult, Latency

log = logging.getLogger(__name__)


def latency_per_provider(
    reference_path: Path | str,
    candidate_path: Path | str,
    dataset: Dataset,
    options: EvaluationOptions,
    factory: ProgressFactory,
) -> tuple[list[Latency], list[tuple[str, str]]]:
    """Interleaved latency on each provider; providers that cannot run are skipped with the reason."""
    runs, warmup, threads, trt_engine_cache = options.runs, options.warmup, options.threads, options.trt_engine_cache
    if not runs:
        return [], []
    _, feed = next(iter(dataset.samples()))
    measured, skipped = [], []
    for provider in requested_providers(options):
        reason = unavailable_reason(provider)
        setup: list[float] = []
        if reason is None:
            try:
                sessions = []
                for path in (reference_path, candidate_path):
                    # Session creation and the first run, apart from inference: TensorRT builds its engine here.
                    began = time.perf_counter()
                    session = create_session(
                        path,
                        str(path),
                        threads=threads,
                        providers=session_providers(provider, trt_engine_cache),
                        spinning=False,
                    )
                    run_session(session, None, feed, str(path))
                    setup.append((time.perf_counter() - began) * 1e3)
                    sessions.append(session)
            except QtoolError as e:
                reason = e.message
            else:
                fell_back = next((s.get_providers() for s in sessions if provider not in s.get_providers()), None)
                if fell_back is not None:  # a provider this build lists but cannot run on this model or machine
                    others = ", ".join(p.removesuffix("ExecutionProvider") for p in fell_back)
                    reason = f"onnxruntime could not start it and fell back to {others}"
        if reason is not None:
            log.warning("latency on %s skipped: %s", provider, reason)
            skipped.append((provider, reason))
            continue
        measured.append(
            measure_latency(
                sessions[0],
                sessions[1],
                feed,
                LatencyRun(runs, warmup, threads, provider, (setup[0], setup[1])),
                on_progress=factory(f"latency {provider.removesuffix('ExecutionProvider')}", runs),
            )
        )
    return measured, skipped


def requested_providers(options: EvaluationOptions) -> list[str]:
    """The execution providers to time on (the CPU when none is named)."""
    return list(options.providers) or ["CPUExecutionProvider"]


def confirmed_latency_gates(
    gates: list[Gate],
    judged: list[GateResult],
    measured: Latency | None,
    paths: tuple[Path | str, Path | str],
    dataset: Dataset,
    options: EvaluationOptions,
    factory: ProgressFactory,
) -> list[GateResult]:
    """``judged`` (a result per gate of ``gates``) with each failed latency gate measured again on fresh sessions.

    Two sessions of one model can differ by a few per cent for their whole life (where their memory
    landed, which core their threads settled on), which no interval over one pair of sessions sees.
    A latency gate that fails is therefore timed once more on new sessions of both models, and fails
    only when that measurement's interval lies above the allowed ratio too; its note gives both.
    """
    failed = [r for r in judged if r.metric == "latency_ratio" and not r.passed and r.measured is not None]
    if not failed or measured is None or measured.latency_ratio_interval is None:
        return judged
    log.info("the latency gate failed; timing both models again on fresh sessions")
    again, _ = latency_per_provider(*paths, dataset, replace(options, providers=(measured.provider,)), factory)
    interval = again[0].latency_ratio_interval if again else None
    if interval is None:
        return judged
    low, high = interval
    results = []
    for gate, result in zip(gates, judged, strict=True):
        if result in failed:
            passed = low <= gate.allowed
            verdict = "passes: the first sessions' difference was not the models'" if passed else "fails again"
            note = f"{result.note}; fresh sessions {low:.3f}-{high:.3f}, {verdict}"
            result = result.model_copy(update={"passed": passed, "note": note})
        results.append(result)
    return results
