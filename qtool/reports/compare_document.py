"""The ``qtool compare --json`` document, built as its schema model (:class:`qtool.schemas.reports.CompareReport`).

The measured parts (error metrics, per-layer rows, latency, the language-model and closed-loop figures, the baseline
change) are already the schema's models: the document holds them as they are.
"""

from __future__ import annotations

from typing import Any

from qtool._version import __version__
from qtool.evaluation.layers import largest_drop
from qtool.results import ComparisonResult
from qtool.schemas import reports as doc

# 2: latency per provider, gates, per-layer, classification, reproducibility; 3: output kinds, box IoU
COMPARE_SCHEMA_VERSION = 3


def _per_layer(layers: list[doc.Layer]) -> doc.PerLayer:
    drop = largest_drop(layers)
    largest = None if drop is None else doc.LargestDrop.model_validate(drop, from_attributes=True)
    return doc.PerLayer(largest_drop=largest, layers=layers)


def comparison_report(result: ComparisonResult) -> doc.CompareReport:
    """The comparison as its schema model (quantize's report embeds it too)."""
    return doc.CompareReport(
        schema_version=COMPARE_SCHEMA_VERSION,
        qtool_version=__version__,
        models=doc.Models(
            reference=doc.ModelRef.model_validate(result.reference, from_attributes=True),
            candidate=doc.ModelRef.model_validate(result.candidate, from_attributes=True),
        ),
        data=doc.Data(dir=result.data_dir, samples=result.samples, calibration_data=result.calibration_data),
        size=doc.Size(
            reference_bytes=result.reference.size_bytes,
            candidate_bytes=result.candidate.size_bytes,
            compression_ratio=result.compression_ratio,
        ),
        accuracy=doc.Accuracy.model_validate(result, from_attributes=True),  # its accuracy fields, by their names
        per_layer=None if result.layers is None else _per_layer(result.layers),
        latency=result.latency,
        skipped_providers=[doc.SkippedProvider(provider=p, reason=why) for p, why in result.skipped_providers],
        gates=doc.Gates(passed=result.gates_passed, results=result.gates),
        baseline=result.baseline,
        reproducibility={
            "reference_sha256": result.reference.sha256,
            "candidate_sha256": result.candidate.sha256,
            **result.reproducibility,
        },
    )


def comparison_to_dict(result: ComparisonResult) -> dict[str, Any]:
    """The ``qtool compare --json`` document (schema: :class:`qtool.schemas.reports.CompareReport`)."""
    return comparison_report(result).model_dump()
