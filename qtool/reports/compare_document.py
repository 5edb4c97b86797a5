"""The ``qtool compare --json`` document, built as its schema model (:class:`qtool.schemas.reports.CompareReport`)."""

from __future__ import annotations

import math
from typing import Any

from qtool._version import __version__
from qtool.evaluation.baseline import BaselineComparison
from qtool.evaluation.closed_loop import ClosedLoopScore
from qtool.evaluation.language_model import LanguageModelScore
from qtool.evaluation.latency import LatencyComparison
from qtool.evaluation.layers import LayerError, largest_drop
from qtool.evaluation.metrics import ErrorMetrics
from qtool.reports.records import filled
from qtool.results import ComparisonResult
from qtool.schemas import reports as doc

# 2: latency per provider, gates, per-layer, classification, reproducibility; 3: output kinds, box IoU
COMPARE_SCHEMA_VERSION = 3


def finite(value: float) -> float | None:
    """JSON has no infinity: an exact match (infinite SQNR) is written as null."""
    return value if math.isfinite(value) else None


def _metrics(m: ErrorMetrics) -> doc.Metrics:
    return filled(doc.Metrics, m)


def _baseline(baseline: BaselineComparison) -> doc.Baseline:
    return filled(doc.Baseline, baseline, changes=[filled(doc.BaselineChange, c) for c in baseline.changes])


def _accuracy(result: ComparisonResult) -> doc.Accuracy:
    return doc.Accuracy(
        overall=_metrics(result.overall),
        outputs=[_metrics(m) for m in result.outputs],
        task=result.task_note,
        output_kinds=result.output_kinds,
        classification=result.agreement,
        boxes=result.boxes,
        language_model=_language_model(result.language_model),
        closed_loop=_closed_loop(result.closed_loop),
        judged=_metrics(result.judged) if result.judged is not None else None,
        judged_note=result.judged_note,
    )


def _closed_loop(score: ClosedLoopScore | None) -> doc.ClosedLoop | None:
    return None if score is None else filled(doc.ClosedLoop, score)


def _language_model(score: LanguageModelScore | None) -> doc.LanguageModel | None:
    return None if score is None else filled(doc.LanguageModel, score)


def _per_layer(layers: list[LayerError]) -> doc.PerLayer:
    drop = largest_drop(layers)
    return doc.PerLayer(
        largest_drop=None if drop is None else filled(doc.LargestDrop, drop),
        layers=[
            filled(
                doc.Layer,
                r,
                drop_db=None if r.uncertain else r.drop_db,
                candidate_tensor=r.candidate_tensor or r.tensor,
                uncertain=r.uncertain or None,
            )
            for r in layers
        ],
    )


def _latency(lat: LatencyComparison) -> doc.Latency:
    return filled(
        doc.Latency,
        lat,
        speedup_interval=lat.speedup_interval or None,
        latency_ratio_interval=lat.ratio_interval or None,
        setup_ms=lat.setup_ms or None,
    )


def _gates(result: ComparisonResult) -> doc.Gates:
    return doc.Gates(
        passed=result.gates_passed,
        results=result.gates,
    )


def comparison_report(result: ComparisonResult) -> doc.CompareReport:
    """The comparison as its schema model (quantize's report embeds it too)."""
    return doc.CompareReport(
        schema_version=COMPARE_SCHEMA_VERSION,
        qtool_version=__version__,
        models=doc.Models(
            reference=filled(doc.ModelRef, result.reference),
            candidate=filled(doc.ModelRef, result.candidate),
        ),
        data=filled(doc.Data, result, dir=result.data_dir),
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
