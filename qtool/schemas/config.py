"""The QConfigDict as pydantic models: one definition for validation and for ``qtool schema config``.

Every field is optional: a user's file is validated as written, then merged over the built-in
``configs/default.yaml``. Models are strict (YAML already gives typed values; ``"yes"`` is not
``true``) and forbid unknown keys. :func:`located_error` turns pydantic's first error into a
QtoolError at the YAML line and column of the offending key or value.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from qtool.errors import QtoolError
from qtool.schemes import (
    CacheGranularity,
    Granularity,
    Mode,
    Rounding,
    RulePlacement,
    SaturationSetting,
    Target,
    WeightFormat,
)

CONFIG_VERSION = 1
# ONNX's FLOAT8E4M3FN: symmetric, per_tensor or per_channel. (qparams also has fp8_e5m2, not offered: onnxruntime
# 1.32's CPU optimizer computes E5M2 Q/DQ models wrongly, and TensorRT runs E4M3 only.)
Fp8Dtype = Literal["fp8_e4m3"]
WeightDtype = Literal["int8", "uint8", "int4", "uint4", "int2", "uint2", Fp8Dtype, "fp16"]
ActivationDtype = Literal["uint8", "int8", "uint16", "int16", Fp8Dtype]  # what onnxruntime's QuantizeLinear runs on CPU
Layout = Literal["NCHW", "NHWC"]
ChannelOrder = Literal["RGB", "BGR"]
PixelDtype = Literal["float32", "float16", "uint8", "int8"]  # a preprocessed image input's element type
# each vocabulary as a tuple, for messages and checks
FP8_DTYPES: tuple[Fp8Dtype, ...] = get_args(Fp8Dtype)
WEIGHT_DTYPES: tuple[WeightDtype, ...] = get_args(WeightDtype)
ACTIVATION_DTYPES: tuple[ActivationDtype, ...] = get_args(ActivationDtype)
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)
ROUNDINGS: tuple[Rounding, ...] = get_args(Rounding)
PLACEMENTS: tuple[RulePlacement, ...] = get_args(RulePlacement)
SATURATION_GUARDS: tuple[SaturationSetting, ...] = get_args(SaturationSetting)
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
CHANNEL_ORDERS: tuple[ChannelOrder, ...] = get_args(ChannelOrder)
PREPROCESS_DTYPES: tuple[PixelDtype, ...] = get_args(PixelDtype)
MAX_BLOCK_SIZE = 1 << 20  # ONNX's block_size attribute is an int64; a block beyond any axis is a typo
MAX_IMAGE_SIDE = 16384  # pixels per side after resize or crop

Positive = Annotated[int, Field(ge=1)]
MAX_LATENCY_RUNS, MAX_SEARCH_SECONDS = 10_000, 86_400
NonNegative = Annotated[int, Field(ge=0, le=MAX_LATENCY_RUNS)]
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SEARCH_SECONDS)]
Size = int | list[Positive]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    # Fields where an explicit ``null`` means something (the default, or "keep in float"); anywhere
    # else ``null`` is an error, as omitting the key is the way to take the default.
    nullable: ClassVar[frozenset[str]] = frozenset()


def _check_observer(value: Any) -> Any:
    """An observer is a name, or a mapping with ``name`` and its options; both must resolve."""
    from qtool.observers import create_observer  # the registry imports nothing of config

    if isinstance(value, dict):
        if not isinstance(value.get("name"), str):
            raise ValueError("an observer mapping needs 'name: <observer>'")
        options = {k: v for k, v in value.items() if k != "name"}
        name = value["name"]
    elif isinstance(value, str):
        name, options = value, {}
    else:
        raise ValueError(f"expected an observer name or a mapping with 'name', got {value!r}")
    try:
        create_observer(name, None, options)
    except QtoolError as e:
        raise ValueError(e.message + (f" ({e.hint})" if e.hint else "")) from None
    return value


ObserverSpec = Annotated[
    str | dict[str, Any],
    BeforeValidator(_check_observer),
    Field(description="an observer name, or {name: ..., <option>: ...}"),
]


class WeightSettings(_Strict):
    """How a node's constant weight is stored."""

    dtype: WeightDtype | None = Field(
        None,
        description="int8 | uint8 | int4 | uint4 | int2 | uint2 | fp8_e4m3 (float8 E4M3FN, symmetric, per_tensor or "
        "per_channel) | fp16 (cast to float16)",
    )
    granularity: Granularity | None = Field(None, description="per_tensor | per_channel | per_block")
    symmetric: bool | None = Field(None, description="zero point 0 (centre for unsigned), narrow range [-qmax, qmax]")
    block_size: Annotated[int, Field(ge=2, le=MAX_BLOCK_SIZE)] | None = Field(
        None, description="per_block only: weights per scale along the reduction axis (null: the default)"
    )
    axis: int | None = Field(
        None,
        description="null: the op's natural axis (per_channel: output channels; per_block: the reduction axis, e.g. K"
        " of a MatMul weight [K, N])",
    )
    saturation: SaturationSetting | None = Field(
        None,
        description="integer-placed nodes with 8-bit activations: x86 CPUs without VNNI saturate int16 sums of uint8 "
        "x int8 products of weights adjacent along the reduction. auto: per node, full-range int8 where no pair "
        "can saturate, the offending channels fitted to the pair limit elsewhere (int8 speed, exact everywhere); "
        "uint8: store int8 weights as uint8 (exact kernels on every CPU, same levels, slow on VNNI CPUs); "
        "reduce_range: int8 in [-64, 63] (fastest, one bit less); ignore: full-range int8, for VNNI / ARM"
        " deployments only",
    )
    final_layer_int8: bool | None = Field(
        None,
        description="weight-only 4/2-bit weights: the final projection (the last weighted node before an output) "
        "keeps int8; a node_name rule wins",
    )
    format: WeightFormat | None = Field(
        None,
        description="qdq: DequantizeLinear (any runtime); matmul_nbits: MatMul weights written as onnxruntime's "
        "com.microsoft MatMulNBits (per_block along K, 2/4/8 bits, block a power of two >= 16)",
    )
    accuracy_level: Annotated[int, Field(ge=0, le=4)] | None = Field(
        None,
        description="matmul_nbits only: 0 float compute; 4 quantizes the activations to int8 per block inside the "
        "kernel (faster on CPUs, a little less accurate)",
    )

    nullable: ClassVar[frozenset[str]] = frozenset({"block_size", "axis"})


class ActivationSettings(_Strict):
    """How a node's float inputs (and the output it feeds an integer consumer) are quantized."""

    dtype: ActivationDtype | None = Field(
        None, description="uint8 | int8 | uint16 | int16 | fp8_e4m3 (float8 E4M3FN, always symmetric)"
    )
    granularity: Literal["per_tensor"] | None = Field(None, description="activations are always per_tensor")
    symmetric: bool | None = Field(None, description="zero point 0 (int8) or the centre (uint8); fp8 always is")
    observer: ObserverSpec | None = Field(
        None, description="null: calibration.observer; or a name / {name: ..., <option>: ...}"
    )

    nullable: ClassVar[frozenset[str]] = frozenset({"observer"})


class AlgorithmSettings(_Strict):
    """Accuracy algorithms applied to the nodes a rule matches (see docs/algorithms.md)."""

    rounding: Rounding | None = Field(
        None,
        description="nearest | gptq | adaround: how weights are rounded onto their grid (gptq and adaround minimise "
        "the output error on the calibration inputs)",
    )
    bias_correction: bool | None = Field(
        None, description="fold the mean output error of the rounded weight into the bias"
    )
    equalization: bool | None = Field(
        None, description="cross-layer equalization of Conv -> Conv chains before calibration"
    )
    smoothquant: bool | None = Field(
        None, description="move MatMul/Gemm activation outliers into the weights before calibration"
    )
    smoothquant_alpha: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="SmoothQuant's migration strength, above 0 and at most 1"
    )
    awq: bool | None = Field(
        None,
        description="AWQ for weight-only MatMul/Gemm (4/2-bit, float activations): scale input channels by their "
        "calibration activations, searched per input tensor",
    )

    @field_validator("smoothquant_alpha", mode="before")
    @classmethod
    def _alpha(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a migration strength above 0 and at most 1, got {value!r}")
        return float(value)


class NodeSettings(_Strict):
    """Settings of the nodes one rule matches; ``null`` in its place keeps them in float."""

    weight: WeightSettings | None = Field(None, description="how the node's constant weight is stored")
    activation: ActivationSettings | None = Field(
        None, description="how the node's float inputs (and the output it feeds an integer consumer) are quantized"
    )
    weight_only: bool | None = Field(None, description="true: quantize weights only, keep activations float")
    placement: RulePlacement | None = Field(
        None,
        description="integer: Q/DQ so onnxruntime runs integer kernels; storage: weights stored quantized, restored "
        "to float at load; auto: integer where a node does enough work per value to gain from it",
    )
    mode: Mode | None = Field(
        None,
        description="static: activations quantized with calibrated ranges (Q/DQ); dynamic: integer MatMul/Gemm "
        "quantize their inputs at run time (no calibration for them; convolutions stay static)",
    )
    algorithms: AlgorithmSettings | None = Field(
        None, description="accuracy algorithms (see docs/algorithms.md); they need calibration data"
    )


class CalibrationSection(_Strict):
    """How ``qtool calibrate`` observes activations."""

    observer: ObserverSpec | None = Field(
        None, description="see `qtool observers`; or {name: percentile, percentile: 99.9}"
    )
    batch_size: Positive | None = Field(None, description="samples per inference when the batch dimension is dynamic")
    limit: Positive | None = Field(None, description="use only the first N samples (null: all)")

    nullable: ClassVar[frozenset[str]] = frozenset({"limit"})


class AccuracySection(_Strict):
    """The sensitivity search run by ``quantize --data``."""

    target_sqnr_db: float | None = Field(
        None,
        description="the worst output's SQNR the measured placement choice aims for; null: no search and no choice "
        "(placement by the rules)",
    )
    max_float_nodes: Positive | None = Field(
        None,
        description="at most this many nodes moved by the sensitivity search (float activations; entirely float "
        "when even storage-only misses the target)",
    )
    samples: Positive | None = Field(
        None, description="samples scored per candidate, and as many others that validate the choice"
    )
    search_seconds: PositiveSeconds | None = Field(None, description="the search stops trying nodes after this long")
    latency_runs: NonNegative | None = Field(
        None,
        description="timing rounds per candidate (0: no timing, the auto candidate with the search's nodes is kept)",
    )
    outputs: list[str] | None = Field(
        None,
        description="the outputs the target judges, by name or 're:' pattern (the others are still reported); "
        "default: every output but the state a model feeds back to an input",
    )
    state: dict[str, str] | None = Field(
        None,
        description="a streaming model's state: each output that is fed back, and the input it feeds "
        "(default: recognised by name and shape, out_cache0 -> in_cache0, stateN -> state, hn -> h0)",
    )

    nullable: ClassVar[frozenset[str]] = frozenset({"target_sqnr_db"})

    @field_validator("target_sqnr_db", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or (value is not None and not isinstance(value, int | float)):
            raise ValueError(f"expected a number of dB or null, got {value!r}")
        return None if value is None else float(value)


class KvCacheSection(_Strict):
    """A decoder's key/value cache stored quantized inside onnxruntime's GroupQueryAttention."""

    dtype: Literal["int8"] = Field(description="int8: the cache onnxruntime's CPU and CUDA GroupQueryAttention keep")
    granularity: CacheGranularity = Field(
        "per_channel", description="per_tensor: one scale per cache; per_channel: one per head and head dimension"
    )


class PreprocessSection(_Strict):
    """How image samples become a model input."""

    resize: Size | None = Field(None, description="image samples: resize to this side or [height, width]")
    center_crop: Size | None = Field(None, description="image samples: crop the centre to this side or [height, width]")
    scale: float | None = Field(None, description="multiply pixel values by this (e.g. 1/255)")
    mean: list[float] | None = Field(None, description="subtract per channel (1 or 3 values)")
    std: list[float] | None = Field(None, description="divide per channel (1 or 3 non-zero values)")
    channel_order: ChannelOrder | None = Field(None, description="RGB | BGR")
    layout: Layout | None = Field(None, description="NCHW | NHWC")
    dtype: PixelDtype | None = Field(None, description="float32 | float16 | uint8 | int8: the input's element type")

    @field_validator("resize", "center_crop", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        def side(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_IMAGE_SIDE

        ok_pair = isinstance(value, list) and len(value) == 2 and all(side(v) for v in value)
        if not (side(value) or ok_pair):
            raise ValueError(f"expected an integer from 1 to {MAX_IMAGE_SIDE} or [height, width], got {value!r:.60}")
        return value

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _per_channel(cls, value: Any) -> Any:
        if (
            not isinstance(value, list)
            or len(value) not in (1, 3)
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"expected a list of 1 or 3 numbers, got {value!r}")
        return [float(v) for v in value]

    @field_validator("std")
    @classmethod
    def _nonzero(cls, value: list[float]) -> list[float]:
        if any(v == 0 for v in value):
            raise ValueError("std values must be non-zero")
        return value

    @field_validator("scale", mode="before")
    @classmethod
    def _scale(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)


class ConfigDocument(_Strict):
    """A QConfigDict file (every key optional; merged over the built-in default)."""

    version: Literal[1] | None = Field(None, description="the config format's version (1)")
    target: Target | None = Field(
        None,
        description="where the model will run; its rules decide what quantize writes (CLI: --target). cpu: "
        "onnxruntime's CPU kernels, on any CPU; cpu_vnni: the same, deployed only to x86 CPUs with VNNI (Intel "
        "since Cascade Lake, AMD since Zen 4) or ARM, where int8 pairs cannot saturate (weight.saturation: auto "
        "becomes ignore); cuda: weights stored quantized (placement auto becomes storage); "
        "tensorrt: symmetric int8 everywhere TensorRT fuses it, Q/DQ on both inputs of every weighted op "
        "and residual Add",
    )
    global_: NodeSettings | None = Field(
        default=None, alias="global", description="applies to every quantizable node (Conv, Gemm, MatMul, Gather)"
    )
    op_type: dict[str, NodeSettings | None] | None = Field(
        None, description="overrides by ONNX op type; null keeps every node of that type in float"
    )
    node_name: dict[str, NodeSettings | None] | None = Field(
        None,
        description="overrides by node name (exact, or re:<RE2 pattern>); they win over op_type; null keeps the node "
        "in float",
    )
    exclude: list[str] | None = Field(
        None, description="node names (exact or re:<pattern>) kept in float, whatever the rules say"
    )
    calibration: CalibrationSection | None = Field(None, description="how qtool calibrate observes activations")
    accuracy: AccuracySection | None = Field(
        None,
        description="how quantize --data chooses what runs as integer kernels (the measured placement choice and "
        "sensitivity search)",
    )
    preprocess: PreprocessSection | None = Field(None, description="how image samples become the model input")
    kv_cache: KvCacheSection | None = Field(
        None,
        description="decoders in onnxruntime's contrib form: quantize the key/value cache of every "
        "GroupQueryAttention, with scales calibrated on the data's prefills and decode steps (null: a float cache)",
    )

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)
    # a section set to null is dropped before the merge: the default applies
    nullable: ClassVar[frozenset[str]] = frozenset(
        {"op_type", "node_name", "exclude", "calibration", "accuracy", "preprocess", "kv_cache"}
    )


def schema_with_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """The config's JSON Schema with each key's default from the built-in ``configs/default.yaml``.

    Every key of a user's file is optional (it is merged over that file), so the models' own
    default is null; the schema states the value a key takes when it is left out instead. Rules
    under ``op_type`` and ``node_name`` take ``global``'s values for the keys they leave out.
    """
    text = resources.files("qtool").joinpath("configs/default.yaml").read_text(encoding="utf-8")
    default = yaml.safe_load(text)
    defs = schema.get("$defs", {})
    sections = {
        "NodeSettings": default["global"],
        "WeightSettings": default["global"]["weight"],
        "ActivationSettings": default["global"]["activation"],
        "AlgorithmSettings": default["global"]["algorithms"],
        "CalibrationSection": default["calibration"],
        "AccuracySection": default["accuracy"],
    }
    for name, values in [*sections.items(), ("", default)]:
        properties = defs.get(name, {}).get("properties", {}) if name else schema.get("properties", {})
        for key, prop in properties.items():
            if key in values and not isinstance(values[key], dict):
                prop["default"] = values[key]
    return schema
