"""``qtool compare --json``: accuracy, size, latency, gates and the baseline change, as pydantic models."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from qtool.schemas.reports.base import _Report


class Metrics(_Report):
    """Error of one output (or of all together) against the reference."""

    name: str
    mse: float
    sqnr_db: float | None = Field(description="null when the outputs are identical (infinite SQNR)")
    cosine: float
    max_abs_error: float
    elements: int


class ModelRef(_Report):
    """A model file by path and digest."""

    path: str
    sha256: str


class Models(_Report):
    """The two models compared."""

    reference: ModelRef
    candidate: ModelRef


class Data(_Report):
    """The evaluation samples."""

    dir: str
    samples: int
    calibration_data: bool = Field(
        False, description="the samples the model was calibrated on (quantize --data without --eval): not held out"
    )


class Size(_Report):
    """On-disk sizes, data files included."""

    reference_bytes: int
    candidate_bytes: int
    compression_ratio: float


class Agreement(_Report):
    """Top-1/top-5 agreement of one classification output."""

    output: str
    top1: float
    top5: float
    rows: int


Kind = Literal["class_scores", "boxes", "next_token", "values"]


class OutputKind(_Report):
    """How one float output was judged, and why."""

    output: str
    kind: Kind = Field(
        description="class_scores: error metrics and top-1/top-5; boxes: error metrics and IoU; "
        "next_token: a decoder's logits, error metrics and the language_model section; values: error only"
    )
    reason: str


class BoxIoU(_Report):
    """Mean IoU of the candidate's (x1, y1, x2, y2) boxes with the reference's, for one box output."""

    output: str
    mean_iou: float
    boxes: int = Field(description="reference boxes with a positive area (empty padding boxes are left out)")


class LanguageModel(_Report):
    """A decoder's metrics: perplexity, next-token agreement and the greedy decode loop through the cache."""

    logits: str
    samples: int
    tokens: int = Field(description="teacher-forced next-token predictions scored per model")
    reference_perplexity: float
    candidate_perplexity: float
    ppl_ratio: float = Field(description="candidate perplexity / reference perplexity (lower is better)")
    next_token_agreement: float = Field(description="fraction of prefill positions with the same most likely token")
    decode_steps: int = Field(description="tokens generated per sample through the cache (0: loop not run)")
    decode_agreement: float | None = Field(
        description="fed the reference's greedy tokens through its own cache, the candidate's next token agrees"
    )
    free_running_agreement: float | None = Field(
        description="the candidate's own greedy tokens equal the reference's, position by position"
    )
    free_running_bound: float | None = Field(
        None,
        description="the free-running agreement a new set of as many samples reaches with 90 % confidence "
        "(bootstrap over the per-sample figures)",
    )
    matched_prefix: float | None = Field(description="mean tokens generated before the first difference")


class ClosedLoop(_Report):
    """A streaming model over sequences, each model feeding its own state back from chunk to chunk."""

    sequences: int
    chunks: int
    state: dict[str, str] = Field(description="state output -> the input it is fed back to")
    outputs: dict[str, float | None] = Field(description="judged output -> SQNR dB over every chunk (null: exact)")
    bounds: dict[str, float | None] = Field(description="judged output -> lower 90 % bound over new sequences")
    worst_sequence_db: float | None = Field(description="the worst judged output on the worst sequence")


class Accuracy(_Report):
    """Error against the reference, overall and per output."""

    overall: Metrics
    outputs: list[Metrics]
    task: str = Field(description="how each output was judged, in one line")
    output_kinds: list[OutputKind]
    classification: list[Agreement]
    boxes: list[BoxIoU]
    language_model: LanguageModel | None = Field(None, description="decoders with a key/value cache only")
    closed_loop: ClosedLoop | None = Field(
        None, description="streaming models over data laid out as sequences (a folder per sequence)"
    )
    judged: Metrics | None = Field(
        None,
        description="the outputs the gates judge, pooled (null: every output, as 'overall'): those --outputs names, "
        "else every output but the state a streaming model feeds back",
    )
    judged_note: str = Field("", description="which outputs are judged and why, in words (empty: every output)")


class LargestDrop(_Report):
    """The layer that loses the most dB."""

    node: str
    tensor: str
    drop_db: float


class Layer(_Report):
    """One intermediate tensor paired between the models."""

    tensor: str
    node: str
    op_type: str
    sqnr_db: float | None
    mse: float
    cosine: float
    input_sqnr_db: float | None
    drop_db: float | None  # None when the pairing is uncertain
    # Defaults keep reports written before structural pairing readable (as baselines).
    candidate_tensor: str = ""  # the candidate tensor measured (its dequantized copy where a clamp was folded)
    paired_by: str = "name"  # "name", "node name" or "structure"
    folded: list[str] = Field(default_factory=list)  # reference ops the candidate node computes too
    uncertain: str | None = None  # why the pairing may be wrong


class PerLayer(_Report):
    """Per-layer error (``--per-layer``)."""

    largest_drop: LargestDrop | None
    layers: list[Layer]


class LatencyStats(_Report):
    """Latency of one model on one provider, in milliseconds."""

    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    runs: int


class Latency(_Report):
    """Both models' latency on one provider."""

    provider: str
    threads: int | None
    reference: LatencyStats
    candidate: LatencyStats
    speedup: float
    speedup_interval: list[float] | None = Field(
        None, description="99 % distribution-free interval of the speed-up (null: too few runs)"
    )
    latency_ratio: float | None = Field(
        None, description="candidate/reference time: the median of the ratios of rounds that ran both models"
    )
    latency_ratio_interval: list[float] | None = Field(
        None, description="99 % interval of latency_ratio, from order statistics; latency gates judge it"
    )
    setup_ms: list[float] | None = Field(
        None,
        description="session creation and first run of reference and candidate, apart from inference "
        "(TensorRT builds its engine then)",
    )
    io_binding: bool = Field(False, description="inputs and outputs bound on the device: no host copies timed")
    candidate_sqnr_db: float | None = Field(
        None, description="worst output SQNR of the candidate run on this provider against the float reference"
    )

    @model_validator(mode="after")
    def _ratios_are_times(self) -> Latency:
        """A ratio of two times is a positive number and its interval runs low to high (a baseline is read back)."""
        ratio, interval = self.latency_ratio, self.latency_ratio_interval
        if ratio is not None and not (0 < ratio < math.inf):
            raise ValueError(f"latency_ratio {ratio} is not a ratio of two times (a positive number)")
        if interval is not None and (len(interval) != 2 or not 0 < interval[0] <= interval[1] < math.inf):
            raise ValueError(f"latency_ratio_interval {interval} is not [low, high] of positive ratios")
        return self


class SkippedProvider(_Report):
    """A provider asked for but not measured, and why."""

    provider: str
    reason: str


class GateResult(_Report):
    """One CI gate and its verdict."""

    gate: str
    metric: str
    direction: str
    threshold: float
    measured: float | None
    passed: bool
    note: str


class Gates(_Report):
    """All gates; ``passed`` is false when any failed."""

    passed: bool
    results: list[GateResult]


class BaselineChange(_Report):
    """One number of the baseline report next to the same number now."""

    metric: str
    baseline: float | None
    current: float | None
    change: float | None
    better: str = Field(description="higher or lower")
    regressed: bool
    note: str


class Baseline(_Report):
    """The change against an earlier report (compare --baseline)."""

    path: str
    same_reference: bool
    same_data: bool
    regressed: bool
    changes: list[BaselineChange]


class CompareReport(_Report):
    """``qtool compare --json``: size, accuracy, per-layer error, latency per provider, gates."""

    schema_version: int
    qtool_version: str
    models: Models
    data: Data
    size: Size
    accuracy: Accuracy
    per_layer: PerLayer | None
    latency: list[Latency]
    skipped_providers: list[SkippedProvider]
    gates: Gates
    baseline: Baseline | None = Field(None, description="the change against compare --baseline REPORT.json")
    reproducibility: dict[str, Any] = Field(description="digests, versions, CPU and settings behind the numbers")
