"""The JSON reports of ``calibrate``, ``quantize``, ``inspect`` and ``compare --json``, as pydantic models.

:mod:`qtool.reports.documents` builds each document as its model, the one definition of its shape, and
writes the model's dump; ``qtool schema quantize-report`` prints the schema. One module per report;
the names are all here, so ``from qtool.schemas import reports as doc`` reaches every model.
"""

from __future__ import annotations

from qtool.schemas.reports.calibrate import CalibrateReport
from qtool.schemas.reports.compare import (
    Accuracy,
    Agreement,
    Baseline,
    BaselineChange,
    BoxIoU,
    ClosedLoop,
    CompareReport,
    Data,
    GateResult,
    Gates,
    LanguageModel,
    LargestDrop,
    Latency,
    LatencyStats,
    Layer,
    Metrics,
    ModelRef,
    Models,
    OutputKind,
    PerLayer,
    Size,
    SkippedProvider,
)
from qtool.schemas.reports.inspect import InspectedModel, InspectedNode, InspectReport, InspectTotals, KeptFloat
from qtool.schemas.reports.quantize import (
    AlgorithmsReport,
    InputModel,
    OutputModel,
    PlacementCandidate,
    PlacementChoiceReport,
    PlacementValidationReport,
    Prepare,
    Quantized,
    QuantizeReport,
    SearchReport,
    SearchStep,
    Skipped,
    WeightForms,
)

__all__ = [
    "Accuracy",
    "Agreement",
    "AlgorithmsReport",
    "Baseline",
    "BaselineChange",
    "BoxIoU",
    "ClosedLoop",
    "LanguageModel",
    "CalibrateReport",
    "CompareReport",
    "Data",
    "GateResult",
    "Gates",
    "InputModel",
    "InspectReport",
    "InspectTotals",
    "InspectedModel",
    "InspectedNode",
    "KeptFloat",
    "LargestDrop",
    "Latency",
    "LatencyStats",
    "Layer",
    "Metrics",
    "ModelRef",
    "Models",
    "OutputKind",
    "OutputModel",
    "PerLayer",
    "PlacementCandidate",
    "PlacementValidationReport",
    "PlacementChoiceReport",
    "Prepare",
    "QuantizeReport",
    "Quantized",
    "SearchReport",
    "SearchStep",
    "Size",
    "Skipped",
    "SkippedProvider",
    "WeightForms",
]
