"""The JSON documents of every command, each built as its schema model (qtool.schemas), which is the one definition."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from qtool.calibration.statistics import CalibrationStats
from qtool.choice.search import FLOAT, FLOAT_ACTIVATIONS, SearchResult
from qtool.choice.selection import PlacementChoice
from qtool.quantization.plan.inspection import Inspection
from qtool.reports.compare_document import comparison_report
from qtool.reports.records import document, file_record, filled
from qtool.results import QuantizeResult
from qtool.schemas import reports as doc
from qtool.schemas.reports.doctor import DoctorReport

SCHEMA_VERSION = 1  # inspect / quantize / calibrate documents


def quantize_to_dict(result: QuantizeResult) -> dict[str, Any]:
    """The ``qtool quantize --json`` document (schema: :class:`qtool.schemas.reports.QuantizeReport`)."""
    rewrite, prepare = result.rewrite, result.prepare
    report = document(
        doc.QuantizeReport,
        result,
        SCHEMA_VERSION,
        input=file_record(doc.InputModel, result.source),
        # bytes: the model file and its external data files
        output=file_record(doc.OutputModel, result.output, data_files=result.data_files),
        quantized=filled(
            doc.Quantized,
            rewrite,
            nodes=rewrite.quantized_nodes,
            weights=rewrite.quantized_weights,
            biases=rewrite.quantized_biases,
            activations=rewrite.quantized_activations,
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
        predicted_kernels=result.kernels,
        float_boundaries=result.boundaries,
        prepare=filled(doc.Prepare, prepare),
        sensitivity=_search(result.search) if result.search else None,
        placement_choice=_choice(result.placement_choice) if result.placement_choice else None,
        comparison=comparison_report(result.comparison) if result.comparison else None,
        peer=result.peer,
    )
    return report.model_dump()


def _search(f: SearchResult) -> doc.SearchReport:
    return filled(
        doc.SearchReport,
        f,
        max_float_nodes=f.max_nodes,
        float_activation_nodes=f.float_nodes if f.moves == FLOAT_ACTIVATIONS else [],
        float_nodes=f.float_nodes if f.moves == FLOAT else [],
        ranked_on_samples=f.ranked_on,
    )


def _choice(c: PlacementChoice) -> doc.PlacementChoiceReport:
    return filled(
        doc.PlacementChoiceReport,
        c,
        range_scores={rule: round(db, 3) for rule, db in c.range_scores.items() if math.isfinite(db)},
        validations=[
            filled(doc.PlacementValidationReport, r.validation, candidate=r.choice, meets_target=r.validation.meets)
            for r in c.validations
        ],
        candidates=[k.model_copy(update={"speedup": c.speedup(k), "chosen": k.name == c.chosen}) for k in c.candidates],
    )


def stats_summary_dict(stats: CalibrationStats, path: str) -> dict[str, Any]:
    """The ``qtool calibrate --json`` summary (schema: :class:`qtool.schemas.reports.CalibrateReport`)."""
    return document(
        doc.CalibrateReport,
        stats,
        SCHEMA_VERSION,
        stats_path=path,
        tensors=len(stats.tensors),
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
    report = document(
        doc.InspectReport,
        result,
        SCHEMA_VERSION,
        model=doc.InspectedModel(path=result.model_path, bytes=result.model_bytes),
        nodes=[
            filled(
                doc.InspectedNode,
                r,
                placement_reason=r.reason,
                predicted_kernel=r.kernel,
                integer_kernel=not r.kernel.startswith("float"),
            )
            for r in result.rows
        ],
        kept_float=[doc.KeptFloat(node=n, op_type=op, reason=why) for n, op, why in result.kept_float],
        passthrough_ops=result.passthrough,
        totals=doc.InspectTotals(
            weight_elements=sum(r.weight_elements for r in result.rows),
            float_bytes=sum(r.float_bytes for r in result.rows),
            quantized_bytes=sum(r.quantized_bytes for r in result.rows),
            predicted_model_bytes=result.predicted_bytes,
            predicted_compression_ratio=result.predicted_ratio,
        ),
    )
    return report.model_dump()


def doctor_to_dict(result: DoctorReport) -> dict[str, Any]:
    """``qtool doctor --json`` (schema: :class:`qtool.schemas.reports.DoctorReport`, which is the record itself)."""
    return result.model_dump()
