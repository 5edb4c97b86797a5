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
from qtool.quantization.plan.inspection import Inspection
from qtool.reports.compare_document import comparison_report, finite
from qtool.results import QuantizeResult
from qtool.schemas import reports as doc
from qtool.system.doctor import Doctor

SCHEMA_VERSION = 1  # inspect / quantize / calibrate documents


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
        comparison=comparison_report(result.comparison) if result.comparison else None,
    )
    return report.model_dump()


def _search(f: SearchResult) -> doc.SearchReport:
    return doc.SearchReport(
        target_sqnr_db=f.target_sqnr_db,
        max_float_nodes=f.max_nodes,
        samples=f.samples,
        initial_sqnr_db=finite(f.initial_sqnr_db),
        final_sqnr_db=finite(f.final_sqnr_db),
        reached=f.reached,
        float_activation_nodes=f.float_nodes if f.moves == FLOAT_ACTIVATIONS else [],
        float_nodes=f.float_nodes if f.moves == FLOAT else [],
        start=f.start,
        steps=[
            doc.SearchStep(
                node=s.node,
                op_type=s.op_type,
                drop_db=s.drop_db,
                sqnr_db=finite(s.sqnr_db),
                kept=s.kept,
                cost_ms=s.cost_ms,
            )
            for s in f.steps
        ],
        ranked_on_samples=f.ranked_on,
        ranked_by=f.ranked_by,
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
                sqnr_db=finite(v.sqnr_db),
                bound_db=finite(v.bound_db),
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
                sqnr_db=finite(k.sqnr_db),
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
