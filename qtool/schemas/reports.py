"""The JSON reports of ``calibrate``, ``quantize`` and ``compare --json``, as pydantic models.

:mod:`qtool.reports.documents` builds each document as its model, the one definition of its shape, and
writes the model's dump; ``qtool schema quantize-report`` prints the schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class OutputKind(_Report):
    """How one float output was judged, and why."""

    output: str
    kind: Literal["class_scores", "boxes", "values"] = Field(
        description="class_scores: error metrics and top-1/top-5; boxes: error metrics and IoU; values: error only"
    )
    reason: str


class BoxIoU(_Report):
    """Mean IoU of the candidate's (x1, y1, x2, y2) boxes with the reference's, for one box output."""

    output: str
    mean_iou: float
    boxes: int = Field(description="reference boxes with a positive area (empty padding boxes are left out)")


class Accuracy(_Report):
    """Error against the reference, overall and per output."""

    overall: Metrics
    outputs: list[Metrics]
    task: str = Field(description="how each output was judged, in one line")
    output_kinds: list[OutputKind]
    classification: list[Agreement]
    boxes: list[BoxIoU]


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


class InputModel(_Report):
    """The float model read."""

    path: str
    bytes: int
    sha256: str


class OutputModel(_Report):
    """The quantized model written."""

    path: str
    bytes: int = Field(description="the model file and its external data files")
    sha256: str
    data_files: list[str]


class Quantized(_Report):
    """What the rewrite quantized, by name."""

    nodes: list[str]
    weights: list[str]
    biases: list[str]
    activations: list[str]


class AlgorithmsReport(_Report):
    """The weight algorithms (``algorithms:`` in the config) applied to each node, and why some were not."""

    applied: dict[str, list[str]] = Field(description="node -> algorithms applied to it")
    not_applied: dict[str, str] = Field(description="node -> why an algorithm it asked for was not applied")


class WeightForms(_Report):
    """How the integer kernels' 8-bit weights are stored (``weight.saturation``; see docs/configuration.md)."""

    counts: dict[str, int] = Field(
        description="form -> integer nodes: 'int8' (full range, no pair can saturate), 'int8 fitted' (channels whose "
        "adjacent weight pairs could saturate AVX2 kernels given a coarser scale), 'int8 (exact kernel)' (depthwise), "
        "'uint8', 'int8 reduced' ([-64, 63]), 'int8 unguarded' (saturation: ignore)"
    )
    nodes: dict[str, str] = Field(description="integer node -> its weight's form")
    fitted_bits: dict[str, float] = Field(
        description="fitted node -> resolution its coarsest channel gave up, in bits (log2 of the scale factor)"
    )


class Skipped(_Report):
    """A node left float, and why."""

    node: str
    reason: str


class Prepare(_Report):
    """What graph preparation changed."""

    constants_to_initializers: int
    folded_batchnorms: list[str]
    folded_shapes: list[str] = Field(
        default_factory=list, description="Shape nodes of initializers replaced by constants"
    )
    folded_weight_layouts: list[str] = Field(
        default_factory=list, description="Transpose/Reshape/Squeeze/Unsqueeze/Flatten/Identity of weights, folded"
    )
    einsums_as_matmuls: list[str] = Field(
        default_factory=list, description="Einsums of an activation and a constant weight, rewritten as MatMuls"
    )
    removed_initializers: int = Field(0, description="initializers no node read any more, dropped")
    opset_before: int
    opset_after: int
    shape_inference_error: str | None


class SearchStep(_Report):
    """One node the sensitivity search tried."""

    node: str
    op_type: str
    drop_db: float
    sqnr_db: float | None
    kept: bool


class SearchReport(_Report):
    """The sensitivity search, when it ran."""

    target_sqnr_db: float
    max_float_nodes: int
    samples: int
    initial_sqnr_db: float | None
    final_sqnr_db: float | None
    reached: bool
    float_activation_nodes: list[str] = Field(description="nodes moved to float activations (weights still quantized)")
    float_nodes: list[str] = Field(
        description="nodes kept entirely float: chosen when even storage-only misses the target, so the weights' "
        "rounding costs accuracy too"
    )
    start: str = Field(description="the candidate placement the search started from (auto, or storage)")
    steps: list[SearchStep]
    ranked_on_samples: int
    stopped: str


class PlacementCandidate(_Report):
    """One placement the choice measured."""

    name: str
    same_as: list[str]
    integer_nodes: int
    storage_nodes: int
    sqnr_db: float | None
    meets_target: bool
    latency_ms: float | None
    speedup: float | None
    chosen: bool


class PlacementChoiceReport(_Report):
    """How quantize chose the placement: candidates scored on samples, then timed against fp32."""

    target_sqnr_db: float
    samples: list[str]
    threads: int
    fp32_ms: float | None
    timing_note: str
    chosen: str
    reason: str
    expects_speedup: bool
    search_note: str
    candidates: list[PlacementCandidate]


class QuantizeReport(_Report):
    """``qtool quantize --json``: what was quantized, how, and (with --data) how it compares."""

    schema_version: int
    qtool_version: str
    input: InputModel
    output: OutputModel
    compression_ratio: float
    calibration_samples: int
    quantized: Quantized
    skipped: list[Skipped]
    passthrough_ops: dict[str, int]
    algorithms: AlgorithmsReport
    weight_forms: WeightForms
    placements: dict[str, int]
    predicted_kernels: dict[str, int]
    prepare: Prepare
    sensitivity: SearchReport | None
    placement_choice: PlacementChoiceReport | None
    notes: list[str]
    comparison: CompareReport | None


class CalibrateReport(_Report):
    """``qtool calibrate --json``: a summary of the statistics written."""

    schema_version: int
    qtool_version: str
    stats_path: str
    observer: str
    samples: int
    tensors: int
    model_sha256: str


class InspectedModel(_Report):
    """The float model inspected."""

    path: str
    bytes: int


class InspectedNode(_Report):
    """What quantize would do to one node."""

    name: str
    op_type: str
    rule: str = Field(description="the config rule that decided the node's settings")
    weight: str = Field(description='e.g. "int4 per_block(32) sym", or "-" without a constant weight')
    activation: str = Field(description='e.g. "uint8 per_tensor asym", or "float" for weight-only nodes')
    weight_elements: int
    float_bytes: int
    quantized_bytes: int
    placement: str = Field(description="integer | dynamic | storage | weight_only | lookup")
    placement_reason: str
    predicted_kernel: str = Field(description='the kernel onnxruntime is predicted to run, e.g. "QLinearConv"')
    integer_kernel: bool
    kernel_reason: str
    algorithms: list[str]
    weight_form: str = Field(
        description="integer nodes: how the 8-bit weight is stored against AVX2 pair saturation ('int8', 'int8 fitted: "
        "N/M channels, B bits', 'uint8' ...; see weight.saturation), '' for other nodes"
    )


class KeptFloat(_Report):
    """A node left in float, and why."""

    node: str
    op_type: str
    reason: str


class InspectTotals(_Report):
    """Sums over the planned nodes, and the predicted size of the quantized model."""

    weight_elements: int
    float_bytes: int
    quantized_bytes: int
    predicted_model_bytes: int = Field(description="exact up to scale values: the rewrite is done with placeholders")
    predicted_compression_ratio: float


class InspectReport(_Report):
    """``qtool inspect --json``: the plan quantize would follow, node by node."""

    schema_version: int
    qtool_version: str
    model: InspectedModel
    nodes: list[InspectedNode]
    kept_float: list[KeptFloat]
    passthrough_ops: dict[str, int]
    totals: InspectTotals
