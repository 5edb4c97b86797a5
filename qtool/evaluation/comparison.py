"""What ``qtool compare`` measures, as one record: the files, each output's errors, latency per provider, gates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qtool.evaluation.gates import LANGUAGE_MODEL_METRICS
from qtool.evaluation.language_model import language_model_measured
from qtool.graph.model_files import ModelFile
from qtool.schemas.reports.compare import (
    Agreement,
    Baseline,
    BoxIoU,
    ClosedLoop,
    GateResult,
    LanguageModel,
    Latency,
    Layer,
    Metrics,
    OutputKind,
)


@dataclass(frozen=True)
class ComparisonResult:
    """Everything ``qtool compare`` measures."""

    reference: ModelFile
    candidate: ModelFile
    data_dir: str
    samples: int
    outputs: list[Metrics]
    overall: Metrics
    latency: list[Latency] = field(default_factory=list)  # one per provider measured
    skipped_providers: list[tuple[str, str]] = field(default_factory=list)  # (provider, reason)
    classification: list[Agreement] = field(default_factory=list)  # top-1/top-5 agreement of class-score outputs
    task: str = ""  # how each output was judged, in one line
    layers: list[Layer] | None = None
    gates: list[GateResult] = field(default_factory=list)
    reproducibility: dict[str, Any] = field(default_factory=dict)
    output_kinds: list[OutputKind] = field(default_factory=list)  # how each float output was judged, and why
    boxes: list[BoxIoU] = field(default_factory=list)  # mean IoU of each box output
    calibration_data: bool = False  # scored on the samples the model was calibrated on (not held out)
    baseline: Baseline | None = None  # the change against an earlier report (compare --baseline)
    language_model: LanguageModel | None = None  # decoders: perplexity, next-token and decode agreement
    closed_loop: ClosedLoop | None = None  # streaming models over sequences: each model's own state fed back
    judged: Metrics | None = None  # the outputs the gates judge pooled, when not every output is judged
    judged_note: str = ""  # which outputs those are, in words
    judged_parts: list[Metrics] = field(default_factory=list)  # their parts of different scales (output_parts)

    @property
    def compression_ratio(self) -> float:
        return self.reference.size_bytes / self.candidate.size_bytes

    @property
    def primary_latency(self) -> Latency | None:
        """The first provider measured (the one latency gates use)."""
        return self.latency[0] if self.latency else None

    @property
    def gates_passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def measured(self) -> dict[str, float | None]:
        """The numbers gates can test, by metric name (the error metrics over the judged outputs)."""
        lat = self.primary_latency
        errors = self.judged or self.overall  # the outputs that matter (see qtool.evaluation.judged)
        # pooled, an output's large part hides its small one: the scale-free figures are also each part's
        return {
            "sqnr": min([errors.sqnr_db, *(p.sqnr_db for p in self.judged_parts)]),
            "cosine": min([errors.cosine, *(p.cosine for p in self.judged_parts)]),
            "mse": errors.mse,
            "max_abs_error": errors.max_abs_error,
            "top1": min((a.top1 for a in self.classification), default=None),
            "top5": min((a.top5 for a in self.classification), default=None),
            "box_iou": min((b.mean_iou for b in self.boxes), default=None),
            "compression": self.compression_ratio,
            "latency_ratio": lat.latency_ratio if lat else None,
            **(
                language_model_measured(self.language_model)
                if self.language_model
                else dict.fromkeys(LANGUAGE_MODEL_METRICS)
            ),
        }

    def intervals(self) -> dict[str, Sequence[float] | None]:
        """Confidence intervals (low, high) of the measured numbers that have one, by metric name."""
        lat = self.primary_latency
        return {"latency_ratio": lat.latency_ratio_interval if lat else None}
