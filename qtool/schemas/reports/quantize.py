"""``qtool quantize --json``: what was quantized, how, the placement choice and its search, as pydantic models."""

from __future__ import annotations

from pydantic import AliasChoices, AliasPath, Field

from qtool.schemas.reports.base import Decibels, FiniteOrNull, _Record, _Report
from qtool.schemas.reports.compare import CompareReport
from qtool.schemes import CandidateName


class InputModel(_Report):
    """The float model read."""

    path: str
    bytes: int = Field(validation_alias=AliasChoices("bytes", "size_bytes"))
    sha256: str


class OutputModel(_Report):
    """The quantized model written."""

    path: str
    bytes: int = Field(
        description="the model file and its external data files", validation_alias=AliasChoices("bytes", "size_bytes")
    )
    sha256: str
    data_files: list[str]


class Quantized(_Report):
    """What the rewrite quantized, by name."""

    # read from the rewrite's report, whose names say quantized_
    nodes: list[str] = Field(validation_alias=AliasChoices("nodes", "quantized_nodes"))
    weights: list[str] = Field(validation_alias=AliasChoices("weights", "quantized_weights"))
    biases: list[str] = Field(validation_alias=AliasChoices("biases", "quantized_biases"))
    activations: list[str] = Field(validation_alias=AliasChoices("activations", "quantized_activations"))
    # unweighted ops (SiLU's Sigmoid and Mul, residual Adds, Concats, pools, reshapes) between integer kernels
    chained_nodes: list[str] = Field(default_factory=list)


class AlgorithmsReport(_Report):
    """The weight algorithms (``algorithms:`` in the config) applied to each node, and why some were not."""

    applied: dict[str, list[str]] = Field(
        description="node -> algorithms applied to it", validation_alias=AliasChoices("applied", "algorithms")
    )
    not_applied: dict[str, str] = Field(
        description="node -> why an algorithm it asked for was not applied",
        validation_alias=AliasChoices("not_applied", "algorithm_notes"),
    )


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
    folded_affine: list[str] = Field(
        default_factory=list,
        description="Mul/Add/Sub/Div by a per-channel constant right after a Conv (a learnable affine block, a "
        "bias written apart), folded into its weight and bias",
    )
    folded_shapes: list[str] = Field(
        default_factory=list, description="Shape nodes of initializers replaced by constants"
    )
    folded_weight_layouts: list[str] = Field(
        default_factory=list, description="Transpose/Reshape/Squeeze/Unsqueeze/Flatten/Identity of weights, folded"
    )
    einsums_as_matmuls: list[str] = Field(
        default_factory=list, description="Einsums of an activation and a constant weight, rewritten as MatMuls"
    )
    folded_computed_weights: list[str] = Field(
        default_factory=list, description="nodes that computed weights from constants at run time, folded"
    )
    hard_activations: list[str] = Field(
        default_factory=list,
        description="hard-sigmoid/hard-swish activations written out as Add, Clip, Div and Mul, and HardSwish ops "
        "(the tensors they write), rewritten as HardSigmoid (times their input for a hard-swish)",
    )
    loops_reading_constant_state: list[str] = Field(
        default_factory=list, description="Loops whose bodies now read the constant state they carry unchanged"
    )
    inlined_functions: list[str] = Field(
        default_factory=list, description="model-local functions (domain:name) whose calls were inlined"
    )
    sorted_nodes: bool = Field(False, description="the nodes were out of order and were sorted topologically")
    removed_initializers: int = Field(0, description="initializers no node read any more, dropped")
    opset_before: int
    opset_after: int
    shape_inference_error: str | None


class SearchStep(_Report):
    """One node the sensitivity search tried."""

    node: str
    op_type: str
    drop_db: float | None = Field(
        description="the SQNR drop the per-layer pass measured (null: not measured, a node inside an If/Loop body)"
    )
    sqnr_db: float | None
    kept: bool
    cost_ms: float | None = Field(
        default=None, description="the latency its move to float was estimated to cost (null: ranked by drop alone)"
    )


class SearchReport(_Report):
    """The sensitivity search, when it ran."""

    target_sqnr_db: float
    max_float_nodes: int
    samples: int
    initial_sqnr_db: FiniteOrNull
    final_sqnr_db: FiniteOrNull
    reached: bool
    float_activation_nodes: list[str] = Field(description="nodes moved to float activations (weights still quantized)")
    float_nodes: list[str] = Field(
        description="nodes kept entirely float: chosen when even storage-only misses the target, so the weights' "
        "rounding costs accuracy too"
    )
    start: CandidateName = Field(
        description="the candidate placement the search started from (auto, unchained, or storage)"
    )
    steps: list[SearchStep]
    ranked_on_samples: int
    ranked_by: str = Field(
        default="drop",
        description="how the nodes were ranked: 'drop' (largest first), or 'dB per ms lost' and what its "
        "milliseconds were read from (the candidates' measured latencies, or each node's work)",
    )
    stopped: str


class PlacementCandidate(_Report):
    """One placement the choice measured (the choice's own record: speedup and chosen are set when it is made)."""

    name: CandidateName
    same_as: list[CandidateName] = Field(description="other candidates that planned exactly this placement")
    integer_nodes: int
    storage_nodes: int
    chained_nodes: int = Field(default=0, description="unweighted ops between its integer kernels run on 8-bit values")
    sqnr_db: Decibels = Field(description="the worst output's SQNR on the scored samples (null: exact)")
    meets_target: bool
    latency_ms: float | None = Field(default=None, description="median at the choice's thread count (null: not timed)")
    speedup: float | None = Field(default=None, description="fp32 median / this one's (null: not timed)")
    chosen: bool = False
    decode_agreement: float | None = Field(
        default=None, description="decoders: agreement with fp32 over greedy decode steps through its own cache"
    )


class PlacementValidationReport(_Report):
    """A placement scored on samples the choice never scored (the kept one is validated last)."""

    # read from a validation round: its choice (the candidate) and its validation
    candidate: str = Field(validation_alias=AliasChoices("candidate", "choice"))
    samples: list[str] = Field(validation_alias=AliasChoices("samples", AliasPath("validation", "samples")))
    # worst output, pooled; null: exact
    sqnr_db: FiniteOrNull = Field(validation_alias=AliasChoices("sqnr_db", AliasPath("validation", "sqnr_db")))
    # its lower confidence bound
    bound_db: FiniteOrNull = Field(validation_alias=AliasChoices("bound_db", AliasPath("validation", "bound_db")))
    # the bound reaches the target
    meets_target: bool = Field(validation_alias=AliasChoices("meets_target", AliasPath("validation", "meets")))


class PlacementChoiceReport(_Report):
    """How quantize chose the placement: candidates scored on samples, then timed against fp32, then validated."""

    target_sqnr_db: float
    samples: list[str]  # the samples every candidate was scored on (the selection half)
    threads: int
    fp32_ms: FiniteOrNull
    timing_note: str
    chosen: str
    reason: str
    expects_speedup: bool
    search_note: str
    confidence: float  # of the validation bounds
    validations: list[PlacementValidationReport]  # empty: too few samples to hold any out
    candidates: list[PlacementCandidate]
    decode_bar: FiniteOrNull = Field(
        None, description="decoders: the dynamic placement's decode agreement, which the kept placement reaches"
    )
    decode_steps: bool = Field(
        False, description="decoders: each sample file was scored as a prefill and as the decode step after it"
    )
    activation_ranges: str = Field(
        "observer", description="activation ranges every candidate uses: 'observer' (clipped) or 'extremes' (min/max)"
    )
    range_scores: dict[str, float] = Field(
        default_factory=dict, description="the all-integer placement's worst output (dB) under each range rule"
    )
    rounding_note: str = Field(
        "", description="storage-only's weights rounded by GPTQ, when rounded to nearest it missed the target"
    )


class PeerRowReport(_Record):
    """One model of ``--vs-onnxruntime``'s side-by-side."""

    model: str = Field(description="'fp32', 'qtool' or 'onnxruntime quantize_static'")
    bytes: int = Field(description="the model file and its external data files")
    worst_sqnr_db: FiniteOrNull = Field(description="worst float output's SQNR against fp32 (null for fp32)")
    speedup_one_thread: FiniteOrNull = Field(description="fp32 time / this model's, 1 intra-op thread")
    speedup_all_threads: FiniteOrNull = Field(description="the same at onnxruntime's default threads (every core)")


class PeerReport(_Record):
    """``--vs-onnxruntime``: onnxruntime's quantize_static model of the same file, measured beside qtool's."""

    recipe: str = Field(description="how onnxruntime's model was made")
    rows: list[PeerRowReport]
    samples: int = Field(description="samples the worst outputs were scored on")
    held_out: bool = Field(description="the scored samples are not the calibration samples")
    cpu: str
    runs: int = Field(description="interleaved timed rounds per thread setting")
    notes: list[str]


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
    # activation QuantizeLinear / DequantizeLinear nodes onnxruntime still runs (CPU targets; {} elsewhere)
    float_boundaries: dict[str, int] = Field(default_factory=dict)
    prepare: Prepare
    sensitivity: SearchReport | None
    placement_choice: PlacementChoiceReport | None
    notes: list[str]
    comparison: CompareReport | None
    peer: PeerReport | None = None
