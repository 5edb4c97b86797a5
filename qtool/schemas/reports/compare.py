"""``qtool compare --json``: accuracy, size, latency, gates and the baseline change, as pydantic models.

The measured parts (:class:`Metrics`, :class:`Layer`, :class:`Latency`, :class:`LanguageModel`, :class:`ClosedLoop`,
:class:`Baseline` ...) are also the records :mod:`qtool.evaluation` returns: built once where they are measured and
dumped as they are. A field the JSON leaves out (what only the library reads) is excluded from the dump and the schema.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from qtool.schemas.reports.base import Decibels, FiniteOrNull, _Record, _Report

SQNR_CAP_DB = 100.0  # an exact match counts as 100 dB when per-layer differences are taken


def capped_db(value: float) -> float:
    """An SQNR as per-layer differences take it: at most :data:`SQNR_CAP_DB`, NaN as its negative."""
    return min(value, SQNR_CAP_DB) if not math.isnan(value) else -SQNR_CAP_DB


class Metrics(_Record):
    """Error of one output (or of all together) against the reference."""

    name: str
    mse: float
    sqnr_db: Decibels = Field(description="null when the outputs are identical (infinite SQNR)")
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


class LanguageModel(_Record):
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
    free_running_bound: FiniteOrNull = Field(
        default=None,
        description="the free-running agreement a new set of as many samples reaches with 90 % confidence "
        "(bootstrap over the per-sample figures)",
    )
    matched_prefix: float | None = Field(description="mean tokens generated before the first difference")
    # each sample's free-running agreement, in sample order (tune's decode goal bounds their mean)
    free_running_by_sample: SkipJsonSchema[tuple[float, ...]] = Field((), exclude=True, repr=False)


class ClosedLoop(_Record):
    """A streaming model over sequences, each model feeding its own state back from chunk to chunk."""

    sequences: int
    chunks: int
    state: dict[str, str] = Field(description="state output -> the input it is fed back to")
    outputs: dict[str, Decibels] = Field(description="judged output -> SQNR dB over every chunk (null: exact)")
    bounds: dict[str, Decibels] = Field(description="judged output -> lower 90 % bound over new sequences")
    worst_sequence_db: Decibels = Field(description="the worst judged output on the worst sequence")


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


class LargestDrop(_Record):
    """The layer that loses the most dB."""

    node: str
    tensor: str
    drop_db: float


class Layer(_Record):
    """One intermediate tensor paired between the models."""

    tensor: str  # the reference tensor
    node: str  # the candidate node that computes it (Q/DQ looked through)
    op_type: str
    sqnr_db: Decibels
    mse: float
    cosine: float
    input_sqnr_db: Decibels  # the worst SQNR among the node's float inputs (capped at SQNR_CAP_DB)
    drop_db: float | None  # input_sqnr_db - sqnr_db (both capped); None when the pairing is uncertain
    # Defaults keep reports written before structural pairing readable (as baselines).
    candidate_tensor: str = ""  # the candidate tensor measured (its dequantized copy where a clamp was folded)
    paired_by: str = "name"  # "name", "node name" or "structure" (see qtool.evaluation.pairing)
    folded: list[str] = Field(default_factory=list)  # reference ops the candidate node computes too
    uncertain: str | None = None  # why the pairing may be wrong
    # not in the JSON: the tensor's order in the reference graph, and input_sqnr_db before the node's own input Q/DQ
    position: SkipJsonSchema[int] = Field(0, exclude=True)
    source_sqnr_db: SkipJsonSchema[float] = Field(SQNR_CAP_DB, exclude=True)

    @property
    def drop_with_inputs_db(self) -> float:
        """The error the node adds including the quantization of its inputs (what float activations undo)."""
        return self.source_sqnr_db - capped_db(self.sqnr_db)


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


class Latency(_Record):
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
    )  # the medians' ratio where no round gave one; None where that is no ratio of two times
    latency_ratio_interval: list[float] | None = Field(
        None, description="99 % interval of latency_ratio, from order statistics; latency gates judge it"
    )
    setup_ms: list[float] | None = Field(
        None,
        description="session creation and first run of reference and candidate, apart from inference "
        "(TensorRT builds its engine then)",
    )
    io_binding: bool = Field(False, description="inputs and outputs bound on the device: no host copies timed")
    candidate_sqnr_db: FiniteOrNull = Field(
        default=None, description="worst output SQNR of the candidate run on this provider against the float reference"
    )  # None on the CPU, whose accuracy is the report's main table

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


class BaselineChange(_Record):
    """One number of the baseline report next to the same number now."""

    metric: str
    baseline: FiniteOrNull
    current: FiniteOrNull
    change: FiniteOrNull  # current - baseline; None when either is missing or infinite
    better: str = Field(description="higher or lower")
    regressed: bool
    note: str
    # not in the JSON: the worst value that is not a regression (the baseline and its tolerance)
    limit: SkipJsonSchema[float | None] = Field(None, exclude=True)


class Baseline(_Record):
    """The change against an earlier report (compare --baseline)."""

    path: str
    same_reference: bool  # the baseline measured the same reference model (by digest)
    same_data: bool  # ... on data of the same name and sample count
    regressed: bool  # some change regressed
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
