"""The JSON documents of every command, each built as its schema model (qtool.schemas), which is the one definition."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace
from typing import Any

from qtool._version import __version__
from qtool.calibration.statistics import CalibrationStats
from qtool.quantization.plan.inspection import Inspection
from qtool.reports.compare_document import comparison_report
from qtool.results import QuantizeResult
from qtool.schemas import reports as doc
from qtool.schemas.reports.doctor import DoctorReport

SCHEMA_VERSION = 1  # inspect / quantize / calibrate documents


def quantize_to_dict(result: QuantizeResult) -> dict[str, Any]:
    """The ``qtool quantize --json`` document (schema: :class:`qtool.schemas.reports.QuantizeReport`)."""
    rewrite, source, output = result.rewrite, result.source, result.output
    report = doc.QuantizeReport(
        schema_version=SCHEMA_VERSION,
        qtool_version=__version__,
        # the files' records and the rewrite's report, read under the report's names
        input=doc.InputModel.model_validate(source, from_attributes=True),
        output=doc.OutputModel.model_validate(
            SimpleNamespace(**vars(output), data_files=result.data_files), from_attributes=True
        ),
        compression_ratio=result.compression_ratio,
        calibration_samples=result.calibration_samples,
        quantized=doc.Quantized.model_validate(rewrite, from_attributes=True),
        skipped=[doc.Skipped(node=node, reason=reason) for node, reason in result.skipped],
        passthrough_ops=rewrite.passthrough,
        algorithms=doc.AlgorithmsReport.model_validate(rewrite, from_attributes=True),
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
        prepare=doc.Prepare.model_validate(result.prepare, from_attributes=True),  # its fields, under their names
        # the search's and the choice's working records, read under the report's names
        sensitivity=doc.SearchReport.model_validate(result.search, from_attributes=True) if result.search else None,
        placement_choice=(
            doc.PlacementChoiceReport.model_validate(result.placement_choice, from_attributes=True)
            if result.placement_choice
            else None
        ),
        notes=result.notes,
        comparison=comparison_report(result.comparison) if result.comparison else None,
        peer=result.peer,
    )
    return report.model_dump()


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
        nodes=result.rows,  # the inspection's records, as they are
        kept_float=[doc.KeptFloat(node=n, op_type=op, reason=why) for n, op, why in result.kept_float],
        passthrough_ops=result.passthrough,
        placement_note=result.placement_note,
        prepare=doc.Prepare.model_validate(result.prepare, from_attributes=True) if result.prepare else None,
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
