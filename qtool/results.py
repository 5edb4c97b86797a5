"""What the commands return: records of the files involved and of what each stage measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtool.choice.search import SearchResult
from qtool.choice.selection import PlacementChoice
from qtool.choice.tune.loop import MarginChoice, Trial
from qtool.choice.tune.sensitivity import Sensitivity
from qtool.choice.validated import Validation, ValidationRound
from qtool.evaluation.comparison import ComparisonResult
from qtool.graph.model_files import ModelFile
from qtool.graph.prepare import PrepareReport
from qtool.progress import ProgressFactory, noop_progress  # noqa: F401 - re-exported
from qtool.quantization.emit.report import RewriteReport
from qtool.schemas.reports.quantize import PeerReport
from qtool.schemas.tune import TuneSamples


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
    peer: PeerReport | None = None  # onnxruntime's quantize_static model of the same file, measured beside

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

    @property
    def samples(self) -> TuneSamples:
        """Which EVAL files chose, validated and measured the nodes (each file named once), as the report says."""
        return TuneSamples(
            selection=self.selection_samples,
            validation=self.validation.samples,
            sensitivity=self.sensitivity.samples,
            decode_steps=self.decode_steps_scored,
        )
