"""The JSON documents of every command, each built as its schema model (qtool.schemas), which is the one definition."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from qtool._version import __version__
from qtool.calibration.statistics import CalibrationStats
from qtool.choice.search import FLOAT, FLOAT_ACTIVATIONS, SearchResult
from qtool.choice.selection import PlacementChoice
from qtool.evaluation.baseline import BaselineComparison
from qtool.evaluation.closed_loop import ClosedLoopScore
from qtool.evaluation.language_model import LanguageModelScore
from qtool.evaluation.layers import LayerError, largest_drop
from qtool.evaluation.metrics import ErrorMetrics, LatencyComparison, LatencyStats
from qtool.quantization.plan.inspection import Inspection
from qtool.results import ComparisonResult, QuantizeResult
from qtool.schemas import reports as doc
from qtool.system.doctor import Doctor

SCHEMA_VERSION = 1  # inspect / quantize / calibrate documents
# 2: latency per provider, gates, per-layer, classification, reproducibility; 3: output kinds, box IoU
COMPARE_SCHEMA_VERSION = 3


def _finite(value: float) -> float | None:
    """JSON has no infinity: an exact match (infinite SQNR) is written as null."""
    return value if math.isfinite(value) else None


def _metrics(m: ErrorMetrics) -> doc.Metrics:
    return doc.Metrics(
        name=m.name,
        mse=m.mse,
        sqnr_db=_finite(m.sqnr_db),
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
        return None if value is None else _finite(value)

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
    )


def _closed_loop(score: ClosedLoopScore | None) -> doc.ClosedLoop | None:
    if score is None:
        return None
    return doc.ClosedLoop(
        sequences=score.sequences,
        chunks=score.chunks,
        state=score.state,
        outputs={name: _finite(db) for name, db in score.outputs.items()},
        bounds={name: _finite(db) for name, db in score.bounds.items()},
        worst_sequence_db=_finite(score.worst_sequence_db),
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
                sqnr_db=_finite(r.sqnr_db),
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
                measured=None if g.measured is None else _finite(g.measured),
                passed=g.passed,
                note=g.note,
            )
            for g in result.gates
        ],
    )


def _comparison(result: ComparisonResult) -> doc.CompareReport:
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
    return _comparison(result).model_dump()


def quantize_to_dict(result: QuantizeResult) -> dict[str, Any]:
    """The ``qtool quantize --json`` document (schema: :class:`qtool.schemas.reports.QuantizeReport`)."""
    rewrite, prepare = result.rewrite, result.prepare
    report = doc.QuantizeReport(
        schema_version=SCHEMA_VERSION,
        qtool_version=__version__,
        input=doc.InputModel(path=result.source.path, bytes=result.source.size_bytes, sha256=result.source.sha256),
        output=doc.OutputModel(
            path=result.output.path,
            bytes=result.output.size_bytes,  # the model file and its external data files
            sha256=result.output.sha256,
            data_files=result.data_files,
        ),
        compression_ratio=result.compression_ratio,
        calibration_samples=result.calibration_samples,
        quantized=doc.Quantized(
            nodes=rewrite.quantized_nodes,
            weights=rewrite.quantized_weights,
            biases=rewrite.quantized_biases,
            activations=rewrite.quantized_activations,
            chained_nodes=rewrite.chained_nodes,
        ),
        skipped=[doc.Skipped(node=node, reason=reason) for node, reason in result.skipped],
        passthrough_ops=rewrite.passthrough,
        algorithms=doc.AlgorithmsReport(applied=rewrite.algorithms, not_applied=rewrite.algorithm_notes),
        weight_forms=doc.WeightForms(
            counts=dict(Counter(rewrite.weight_forms.values()).most_common()),
            nodes=rewrite.weight_forms,
            fitted_bits={
                node: round(fit.bits_lost, 3) for node, fit in rewrite.pair_fits.items() if fit.coarsest > 1.0
            },
        ),
        placements=result.placements,
        predicted_kernels=result.kernels,
        float_boundaries=result.boundaries,
        prepare=doc.Prepare(
            constants_to_initializers=prepare.constants_to_initializers,
            folded_batchnorms=prepare.folded_batchnorms,
            folded_shapes=prepare.folded_shapes,
            folded_weight_layouts=prepare.folded_weight_layouts,
            einsums_as_matmuls=prepare.einsums_as_matmuls,
            removed_initializers=prepare.removed_initializers,
            opset_before=prepare.opset_before,
            opset_after=prepare.opset_after,
            shape_inference_error=prepare.shape_inference_error,
        ),
        sensitivity=_search(result.search) if result.search else None,
        placement_choice=_choice(result.placement_choice) if result.placement_choice else None,
        notes=result.notes,
        comparison=_comparison(result.comparison) if result.comparison else None,
    )
    return report.model_dump()


def _search(f: SearchResult) -> doc.SearchReport:
    return doc.SearchReport(
        target_sqnr_db=f.target_sqnr_db,
        max_float_nodes=f.max_nodes,
        samples=f.samples,
        initial_sqnr_db=_finite(f.initial_sqnr_db),
        final_sqnr_db=_finite(f.final_sqnr_db),
        reached=f.reached,
        float_activation_nodes=f.float_nodes if f.moves == FLOAT_ACTIVATIONS else [],
        float_nodes=f.float_nodes if f.moves == FLOAT else [],
        start=f.start,
        steps=[
            doc.SearchStep(node=s.node, op_type=s.op_type, drop_db=s.drop_db, sqnr_db=_finite(s.sqnr_db), kept=s.kept)
            for s in f.steps
        ],
        ranked_on_samples=f.ranked_on,
        stopped=f.stopped,
    )


def _choice(c: PlacementChoice) -> doc.PlacementChoiceReport:
    return doc.PlacementChoiceReport(
        target_sqnr_db=c.target_sqnr_db,
        samples=c.samples,
        threads=c.threads,
        fp32_ms=c.fp32_ms,
        timing_note=c.timing_note,
        chosen=c.chosen,
        reason=c.reason,
        expects_speedup=c.expects_speedup,
        search_note=c.search_note,
        confidence=c.confidence,
        decode_bar=c.decode_bar,
        decode_steps=c.decode_steps,
        activation_ranges=c.activation_ranges,
        range_scores={rule: round(db, 3) for rule, db in c.range_scores.items() if math.isfinite(db)},
        validations=[
            doc.PlacementValidationReport(
                candidate=v.candidate,
                samples=list(v.samples),
                sqnr_db=_finite(v.sqnr_db),
                bound_db=_finite(v.bound_db),
                meets_target=v.meets_target,
            )
            for v in c.validations
        ],
        candidates=[
            doc.PlacementCandidate(
                name=k.name,
                same_as=list(k.same_as),
                integer_nodes=k.integer_nodes,
                storage_nodes=k.storage_nodes,
                chained_nodes=k.chained_nodes,
                sqnr_db=_finite(k.sqnr_db),
                meets_target=k.meets_target,
                latency_ms=k.latency_ms,
                decode_agreement=k.decode_agreement,
                speedup=c.speedup(k),
                chosen=k.name == c.chosen,
            )
            for k in c.candidates
        ],
    )


def stats_summary_dict(stats: CalibrationStats, path: str) -> dict[str, Any]:
    """The ``qtool calibrate --json`` summary (schema: :class:`qtool.schemas.reports.CalibrateReport`)."""
    return doc.CalibrateReport(
        schema_version=SCHEMA_VERSION,
        qtool_version=__version__,
        stats_path=path,
        observer=stats.observer,
        samples=stats.samples,
        tensors=len(stats.tensors),
        model_sha256=stats.model_sha256,
    ).model_dump()


def to_json(document: dict[str, Any]) -> str:
    """Stable, pretty JSON text; a non-finite number is written as null (``NaN``/``Infinity`` are not JSON)."""
    return json.dumps(_finite_tree(document), indent=2, sort_keys=False, allow_nan=False) + "\n"


def _finite_tree(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_tree(v) for v in value]
    return value


def inspection_to_dict(result: Inspection) -> dict[str, Any]:
    """The ``qtool inspect --json`` document (schema: :class:`qtool.schemas.reports.InspectReport`)."""
    report = doc.InspectReport(
        schema_version=SCHEMA_VERSION,
        qtool_version=__version__,
        model=doc.InspectedModel(path=result.model_path, bytes=result.model_bytes),
        nodes=[
            doc.InspectedNode(
                name=r.name,
                op_type=r.op_type,
                rule=r.rule,
                weight=r.weight,
                activation=r.activation,
                weight_elements=r.weight_elements,
                float_bytes=r.float_bytes,
                quantized_bytes=r.quantized_bytes,
                placement=r.placement,
                placement_reason=r.reason,
                predicted_kernel=r.kernel,
                integer_kernel=not r.kernel.startswith("float"),
                kernel_reason=r.kernel_reason,
                algorithms=list(r.algorithms),
                weight_form=r.weight_form,
            )
            for r in result.rows
        ],
        kept_float=[doc.KeptFloat(node=n, op_type=op, reason=why) for n, op, why in result.kept_float],
        passthrough_ops=result.passthrough,
        placement_note=result.placement_note,
        totals=doc.InspectTotals(
            weight_elements=sum(r.weight_elements for r in result.rows),
            float_bytes=sum(r.float_bytes for r in result.rows),
            quantized_bytes=sum(r.quantized_bytes for r in result.rows),
            predicted_model_bytes=result.predicted_bytes,
            predicted_compression_ratio=result.predicted_ratio,
        ),
    )
    return report.model_dump()


def doctor_to_dict(result: Doctor) -> dict[str, Any]:
    """``qtool doctor --json``."""
    return {
        "schema_version": 1,
        "versions": result.versions,
        "system": result.system,
        "cpu": result.cpu,
        "int8_kernels_saturate": result.int8_saturates,
        "providers": [{"name": p.name, "loads": p.loads, "detail": p.detail} for p in result.providers],
        "qdq_kernel_opsets": result.qdq_opsets,
        "gpus": result.gpus,
    }
