"""What the commands return: records of the files involved and of what each stage measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtool.choice.search import SearchResult
from qtool.choice.selection import PlacementChoice
from qtool.choice.tune.loop import MarginChoice, Trial
from qtool.choice.tune.sensitivity import Sensitivity
from qtool.choice.validated import Validation, ValidationRound
from qtool.evaluation.baseline import BaselineComparison
from qtool.evaluation.closed_loop import ClosedLoopScore
from qtool.evaluation.gates import LANGUAGE_MODEL_METRICS
from qtool.evaluation.language_model import LanguageModelScore
from qtool.evaluation.latency import LatencyComparison
from qtool.evaluation.layers import LayerError
from qtool.evaluation.metrics import ErrorMetrics
from qtool.evaluation.peer import PeerComparison
from qtool.graph.model_files import files_sha256, model_files
from qtool.graph.prepare import PrepareReport
from qtool.progress import ProgressFactory, noop_progress  # noqa: F401 - re-exported
from qtool.quantization.emit.report import RewriteReport
from qtool.schemas.reports.compare import Agreement, BoxIoU, GateResult, OutputKind


@dataclass(frozen=True)
class ModelFile:
    """A model file on disk."""

    path: str
    size_bytes: int
    sha256: str

    @classmethod
    def of(cls, path: Path | str) -> ModelFile:
        """Size and digest of the model file and the external data files it names."""
        files = model_files(path)
        return cls(str(path), sum(f.stat().st_size for f in files), files_sha256(files))


@dataclass(frozen=True)
class ComparisonResult:
    """Everything ``qtool compare`` measures."""

    reference: ModelFile
    candidate: ModelFile
    data_dir: str
    samples: int
    outputs: list[ErrorMetrics]
    overall: ErrorMetrics
    latency: list[LatencyComparison] = field(default_factory=list)  # one per provider measured
    skipped_providers: list[tuple[str, str]] = field(default_factory=list)  # (provider, reason)
    agreement: list[Agreement] = field(default_factory=list)
    task_note: str = ""
    layers: list[LayerError] | None = None
    gates: list[GateResult] = field(default_factory=list)
    reproducibility: dict[str, Any] = field(default_factory=dict)
    output_kinds: list[OutputKind] = field(default_factory=list)  # how each float output was judged, and why
    boxes: list[BoxIoU] = field(default_factory=list)  # mean IoU of each box output
    calibration_data: bool = False  # scored on the samples the model was calibrated on (not held out)
    baseline: BaselineComparison | None = None  # the change against an earlier report (compare --baseline)
    language_model: LanguageModelScore | None = None  # decoders: perplexity, next-token and decode agreement
    closed_loop: ClosedLoopScore | None = None  # streaming models over sequences: each model's own state fed back
    judged: ErrorMetrics | None = None  # the outputs the gates judge pooled, when not every output is judged
    judged_note: str = ""  # which outputs those are, in words
    judged_parts: list[ErrorMetrics] = field(default_factory=list)  # their parts of different scales (output_parts)

    @property
    def compression_ratio(self) -> float:
        return self.reference.size_bytes / self.candidate.size_bytes

    @property
    def primary_latency(self) -> LatencyComparison | None:
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
            "top1": min((a.top1 for a in self.agreement), default=None),
            "top5": min((a.top5 for a in self.agreement), default=None),
            "box_iou": min((b.mean_iou for b in self.boxes), default=None),
            "compression": self.compression_ratio,
            "latency_ratio": lat.latency_ratio if lat else None,
            **(self.language_model.measured() if self.language_model else dict.fromkeys(LANGUAGE_MODEL_METRICS)),
        }

    def intervals(self) -> dict[str, tuple[float, float] | None]:
        """Confidence intervals of the measured numbers that have one, by metric name."""
        lat = self.primary_latency
        return {"latency_ratio": lat.ratio_interval if lat else None}


@dataclass
class QuantizeResult:
    """What ``qtool quantize`` did and, with data, how the result compares."""

    source: ModelFile
    output: ModelFile
    prepare: PrepareReport
    rewrite: RewriteReport
    skipped: list[tuple[str, str]]
    calibration_samples: int
    comparison: ComparisonResult | None = None
    notes: list[str] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)  # integer / storage / weight_only -> nodes
    kernels: dict[str, int] = field(default_factory=dict)  # kernel onnxruntime (CPU) is predicted to run -> nodes
    boundaries: dict[str, int] = field(default_factory=dict)  # activation Q / DQ nodes no integer kernel absorbs
    search: SearchResult | None = None  # the sensitivity search, when a target SQNR was given
    placement_choice: PlacementChoice | None = None  # the measured choice of placement, with data
    data_files: list[str] = field(default_factory=list)  # external data written beside the output
    peer: PeerComparison | None = None  # onnxruntime's quantize_static model of the same file, measured beside

    @property
    def compression_ratio(self) -> float:
        return self.source.size_bytes / self.output.size_bytes


@dataclass
class TuneResult:
    """What ``qtool tune`` tried, chose and wrote."""

    source: ModelFile
    output: ModelFile
    config_out: str
    objective: str
    goal: str  # e.g. "SQNR >= 30 dB" or "mytask:top1 >= 0.9"
    target_sqnr_db: float | None  # the SQNR goal (None: a metric goal)
    nodes: int  # nodes tuned
    trials: list[Trial]
    chosen: Trial
    written: Trial  # the written model (built by quantize from CHOSEN.yaml), scored on the selection samples
    validation: Validation  # the written model on the validation samples: the promise is its bound
    rounds: list[ValidationRound[MarginChoice]]  # each choice validated, in order (a miss raised the margin)
    margin: float  # the selection margin the last choice was made with (goal units)
    confidence: float  # of the bounds on the selection samples, and of the promise as a whole
    validation_confidence: float  # of each validated choice's bound (corrected for the choices validated)
    selection_samples: list[str]  # the EVAL files that chose (the validation files are in ``validation``)
    met: bool  # the written model's validated bound meets the goal (otherwise it is the most accurate tried)
    reachable: bool  # some quantized candidate met the goal on the selection samples
    out_of_time: bool  # the time budget stopped the search
    stalled: bool  # the refinement stopped because its last verifications no longer paid
    sensitivity: Sensitivity
    seconds: float
    time_budget: float
    notes: list[str] = field(default_factory=list)
    decode_steps_scored: bool = False  # a decoder's EVAL files: each scored as a prefill and as the decode step after
