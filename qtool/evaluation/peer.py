"""qtool's model beside onnxruntime's ``quantize_static`` model of the same file, measured in one run.

Both quantize the same float file on the same calibration samples (onnxruntime by its usual recipe, see
:mod:`qtool.evaluation.onnxruntime_static`); both are scored against the float model on the same
samples (the worst float output's SQNR, each output pooled over the samples) and timed interleaved with
the float model, once at 1 intra-op thread and once at onnxruntime's default (every core), so each
speed-up is the median of paired per-round ratios measured under the same machine state.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx

from qtool.calibration.dataset import Dataset
from qtool.calibration.dataset_types import Feed
from qtool.evaluation.latency import LATENCY_BLOCK_SECONDS, paired_ratio
from qtool.evaluation.metrics import output_metrics
from qtool.evaluation.onnxruntime_static import RECIPE, quantize_with_onnxruntime
from qtool.evaluation.output_kinds import output_sources
from qtool.evaluation.timing import Rounds, time_interleaved
from qtool.graph.model_files import model_files
from qtool.graph.session import create_session
from qtool.schemas.reports.quantize import PeerReport, PeerRowReport
from qtool.system.environment import cpu_info

ONNXRUNTIME = "onnxruntime quantize_static"


@dataclass(frozen=True)
class PeerRun:
    """What the side-by-side reads: the float file, qtool's written model, and the samples."""

    float_path: Path
    qtool_path: Path
    calibration: Iterable[Feed]  # onnxruntime's calibration feeds (the samples qtool calibrated on)
    scored: Dataset
    held_out: bool
    runs: int = 20
    warmup: int = 2


def beside_onnxruntime(run: PeerRun) -> PeerReport:
    """Quantize ``run.float_path`` with onnxruntime and measure it beside qtool's model and fp32.

    When onnxruntime cannot quantize the model, the comparison holds fp32 and qtool and a note says why.
    """
    cpu = cpu_info()
    with tempfile.TemporaryDirectory(prefix="qtool-peer-") as scratch:
        models = {"fp32": run.float_path, "qtool": run.qtool_path}
        peer_path = Path(scratch) / "onnxruntime.onnx"
        try:
            notes = quantize_with_onnxruntime(run.float_path, run.calibration, peer_path)
            models[ONNXRUNTIME] = peer_path
        except Exception as e:  # noqa: BLE001 - a peer's failure is a finding to report, not qtool's error
            lines = str(e).strip().splitlines()
            said = f": {lines[0][:300]}" if lines else ""
            notes = [f"onnxruntime's quantize_static failed on this model ({type(e).__name__}{said})"]
        worst = _worst_outputs(models, run.scored)
        one = _speedups(models, run, threads=1)
        every = _speedups(models, run, threads=None)
        sizes = {name: sum(f.stat().st_size for f in model_files(path)) for name, path in models.items()}
        rows = [
            PeerRowReport(
                model=name,
                bytes=sizes[name],
                worst_sqnr_db=worst.get(name),
                speedup_one_thread=one.get(name),
                speedup_all_threads=every.get(name),
            )
            for name in models
        ]
    flags = ", ".join(f for f in cpu["flags"] if "vnni" in f or f.startswith("avx512f")) or "no VNNI"
    return PeerReport(
        recipe=RECIPE,
        rows=rows,
        samples=len(run.scored),
        held_out=run.held_out,
        cpu=f"{cpu['model']} ({flags})",
        runs=run.runs,
        notes=notes,
    )


def _worst_outputs(models: dict[str, Path], scored: Dataset) -> dict[str, float]:
    """Each quantized model's worst float output SQNR against fp32 on ``scored`` (outputs pooled over samples)."""
    reference = create_session(models["fp32"], "the float model")
    sources = output_sources(onnx.load(str(models["fp32"]), load_external_data=False))  # rows a selection orders
    worst = {}
    for name, path in models.items():
        if name == "fp32":
            continue
        candidate = create_session(path, f"the {name} model")
        measured = output_metrics(reference, candidate, scored, sources, task="none")
        worst[name] = min((o.sqnr_db for o in measured.outputs), default=measured.overall.sqnr_db)
    return worst


def _speedups(models: dict[str, Path], run: PeerRun, threads: int | None) -> dict[str, float]:
    """fp32 time over each model's, the median of paired rounds timed interleaved at ``threads``."""
    feed = next(iter(run.scored.samples()))[1]
    sessions = {}
    for name, path in models.items():
        sessions[name] = create_session(path, f"the {name} model", threads=threads, spinning=False)
    rounds = Rounds(run.runs, minimum=run.runs, warmup=run.warmup, block_seconds=LATENCY_BLOCK_SECONDS)
    times, _ = time_interleaved(sessions, feed, rounds)
    speedups = {}
    for name in models:
        ratio, _ = paired_ratio(times["fp32"], times[name])
        speedups[name] = 1 / ratio if ratio and ratio > 0 else math.nan
    return speedups
