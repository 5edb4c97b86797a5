"""The ``qtool compare --json`` document, built as its schema model (:class:`qtool.schemas.reports.CompareReport`)."""

from __future__ import annotations

import math
from typing import Any

from qtool._version import __version__
from qtool.evaluation.baseline import BaselineComparison
from qtool.evaluation.closed_loop import ClosedLoopScore
from qtool.evaluation.language_model import LanguageModelScore
from qtool.evaluation.layers import LayerError, largest_drop
from qtool.evaluation.metrics import ErrorMetrics, LatencyComparison, LatencyStats
from qtool.results import ComparisonResult
from qtool.schemas import reports as doc

# 2: latency per provider, gates, per-layer, classification, reproducibility; 3: output kinds, box IoU
COMPARE_SCHEMA_VERSION = 3


def finite(value: float) -> float | None:
    """JSON has no infinity: an exact match (infinite SQNR) is written as null."""
    return value if math.isfinite(value) else None


def _metrics(m: ErrorMetrics) -> doc.Metrics:
    return doc.Metrics(
        name=m.name,
        mse=m.mse,
        sqnr_db=finite(m.sqnr_db),
        cosine=m.cosine,
        max_abs_error=m.max_abs_error,
        elements=m.elements,
    )


def _latency_stats(stats: LatencyStats) -> doc.LatencyStats:
    return doc.LatencyStats(
        median_ms=stats.median_ms, p90_ms=stats.p90_ms, p99_ms=stats.p99_ms, mean_ms=stats.mean_ms, runs=stats.runs
    )


def _baseline(baseline: BaselineComparison) -> doc.Baseline:
    def number(value: float | None) -> float | None:
        return None if value is None else finite(value)

    return doc.Baseline(
        path=baseline.path,
        same_reference=baseline.same_reference,
        same_data=baseline.same_data,
        regressed=baseline.regressed,
        changes=[
            doc.BaselineChange(
                metric=c.metric,
                baseline=number(c.baseline),
                current=number(c.current),
                change=number(c.change),
                better=c.better,
                regressed=c.regressed,
                note=c.note,
            )
            for c in baseline.changes
        ],
    )


def _accuracy(result: ComparisonResult) -> doc.Accuracy:
    return doc.Accuracy(
        overall=_metrics(result.overall),
        outputs=[_metrics(m) for m in result.outputs],
        task=result.task_note,
        output_kinds=[doc.OutputKind(output=k.name, kind=k.kind, reason=k.reason) for k in result.output_kinds],
        classification=[doc.Agreement(output=a.name, top1=a.top1, top5=a.top5, rows=a.rows) for a in result.agreement],
        boxes=[doc.BoxIoU(output=b.name, mean_iou=b.mean_iou, boxes=b.boxes) for b in result.boxes],
        language_model=_language_model(result.language_model),
        closed_loop=_closed_loop(result.closed_loop),
        judged=_metrics(result.judged) if result.judged is not None else None,
        judged_note=result.judged_note,
    )


def _closed_loop(score: ClosedLoopScore | None) -> doc.ClosedLoop | None:
    if score is None:
        return None
    return doc.ClosedLoop(
        sequences=score.sequences,
        chunks=score.chunks,
        state=score.state,
        outputs={name: finite(db) for name, db in score.outputs.items()},
        bounds={name: finite(db) for name, db in score.bounds.items()},
        worst_sequence_db=finite(score.worst_sequence_db),
    )


def _language_model(score: LanguageModelScore | None) -> doc.LanguageModel | None:
    if score is None:
        return None
    return doc.LanguageModel(
        logits=score.logits,
        samples=score.samples,
        tokens=score.tokens,
        reference_perplexity=score.reference_perplexity,
        candidate_perplexity=score.candidate_perplexity,
        ppl_ratio=score.ppl_ratio,
        next_token_agreement=score.next_token_agreement,
        decode_steps=score.decode_steps,
        decode_agreement=score.decode_agreement,
        free_running_agreement=score.free_running_agreement,
        free_running_bound=score.free_running_bound,
        matched_prefix=score.matched_prefix,
    )


def _per_layer(layers: list[LayerError]) -> doc.PerLayer:
    drop = largest_drop(layers)
    return doc.PerLayer(
        largest_drop=None
        if drop is None
        else doc.LargestDrop(node=drop.node, tensor=drop.tensor, drop_db=drop.drop_db),
        layers=[
            doc.Layer(
                tensor=r.tensor,
                node=r.node,
                op_type=r.op_type,
                sqnr_db=finite(r.sqnr_db),
                mse=r.mse,
                cosine=r.cosine,
                input_sqnr_db=r.input_sqnr_db,
                drop_db=None if r.uncertain else r.drop_db,
                candidate_tensor=r.candidate_tensor or r.tensor,
                paired_by=r.paired_by,
                folded=list(r.folded),
                uncertain=r.uncertain or None,
            )
            for r in layers
        ],
    )


def _latency(lat: LatencyComparison) -> doc.Latency:
    return doc.Latency(
        provider=lat.provider,
        threads=lat.threads,
        reference=_latency_stats(lat.reference),
        candidate=_latency_stats(lat.candidate),
        speedup=lat.speedup,
        speedup_interval=list(lat.speedup_interval) if lat.speedup_interval else None,
        latency_ratio=lat.latency_ratio,
        latency_ratio_interval=list(lat.ratio_interval) if lat.ratio_interval else None,
        setup_ms=list(lat.setup_ms) if lat.setup_ms else None,
        io_binding=lat.io_binding,
        candidate_sqnr_db=lat.candidate_sqnr_db,
    )


def _gates(result: ComparisonResult) -> doc.Gates:
    return doc.Gates(
        passed=result.gates_passed,
        results=[
            doc.GateResult(
                gate=g.gate.label,
                metric=g.gate.metric,
                direction=g.gate.direction,
                threshold=g.gate.threshold,
                measured=None if g.measured is None else finite(g.measured),
                passed=g.passed,
                note=g.note,
            )
            for g in result.gates
        ],
    )


def comparison_report(result: ComparisonResult) -> doc.CompareReport:
    """The comparison as its schema model (quantize's report embeds it too)."""
    return doc.CompareReport(
        schema_version=COMPARE_SCHEMA_VERSION,
        qtool_version=__version__,
        models=doc.Models(
            reference=doc.ModelRef(path=result.reference.path, sha256=result.reference.sha256),
            candidate=doc.ModelRef(path=result.candidate.path, sha256=result.candidate.sha256),
        ),
        data=doc.Data(dir=result.data_dir, samples=result.samples, calibration_data=result.calibration_data),
        size=doc.Size(
            reference_bytes=result.reference.size_bytes,
            candidate_bytes=result.candidate.size_bytes,
            compression_ratio=result.compression_ratio,
        ),
        accuracy=_accuracy(result),
        per_layer=None if result.layers is None else _per_layer(result.layers),
        latency=[_latency(lat) for lat in result.latency],
        skipped_providers=[doc.SkippedProvider(provider=p, reason=why) for p, why in result.skipped_providers],
        gates=_gates(result),
        baseline=_baseline(result.baseline) if result.baseline else None,
        reproducibility={
            "reference_sha256": result.reference.sha256,
            "candidate_sha256": result.candidate.sha256,
            **result.reproducibility,
        },
    )


def comparison_to_dict(result: ComparisonResult) -> dict[str, Any]:
    """The ``qtool compare --json`` document (schema: :class:`qtool.schemas.reports.CompareReport`)."""
    return comparison_report(result).model_dump()
