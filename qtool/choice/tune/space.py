"""What ``qtool tune`` may choose for each node: weight precision and whether activations are quantized.

Each :class:`Option` is a ``node_name`` entry of a QConfigDict, so any choice of options is a config
that ``qtool quantize --config`` reproduces. The options a target allows follow its rules: TensorRT
runs int8 only with int8 on both inputs of a layer, CUDA runs Q/DQ models in float (quantized
weights are stored and restored at load), the CPU runs all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qtool.schemas.config import NodeSettings

FP16_NSR = 1e-7  # noise-to-signal power of fp16 weights (11-bit mantissa): far below any target
INT16_GAIN = 2.0**-16  # int16 activations: 256x finer steps than 8 bits, so 65536x less noise power


@dataclass(frozen=True)
class Option:
    """One precision a node may get; ``entry`` is its ``node_name:`` value (None keeps it float)."""

    name: str
    entry: dict[str, Any] | None
    integer: bool = False  # runs integer kernels (quantized activations): faster where the node does enough work

    @property
    def settings(self) -> NodeSettings | None:
        """``entry`` validated by the config's schema (what a candidate config is built from)."""
        return _validated(self.name, self.entry)


_SETTINGS: dict[str, NodeSettings] = {}


def _validated(name: str, entry: dict[str, Any] | None) -> NodeSettings | None:
    if entry is None:
        return None
    if name not in _SETTINGS:
        _SETTINGS[name] = NodeSettings.model_validate(entry)
    return _SETTINGS[name]


BLOCK_SIZE = 32  # the per-block options' scale per 32 weights along the reduction axis (their byte cost counts it)


def _weights(dtype: str, granularity: str, **extra: Any) -> dict[str, Any]:
    weight: dict[str, Any] = {"dtype": dtype, "granularity": granularity, "final_layer_int8": False}
    if granularity == "per_block":
        weight["block_size"] = BLOCK_SIZE
    return {"weight": weight, **extra}


FLOAT = Option("float", None)
FP16 = Option("fp16", _weights("fp16", "per_tensor", weight_only=True))
W8 = Option("w8", _weights("int8", "per_channel", weight_only=True, placement="storage"))
W8A8 = Option("w8a8", _weights("int8", "per_channel", weight_only=False, placement="integer"), integer=True)
W8A16 = Option(
    "w8a16",
    {**_weights("int8", "per_channel", weight_only=False, placement="integer"), "activation": {"dtype": "int16"}},
)
W8_BLOCKS = Option("w8b", _weights("int8", "per_block", weight_only=True))  # a scale per 32 weights: outliers hurt less
W4 = Option("w4", _weights("int4", "per_block", weight_only=True))
GPTQ = {"algorithms": {"rounding": "gptq"}}  # rounding that minimises the output error on calibration inputs
# With float inputs, bias correction cancels the mean shift of the rounded weight exactly (analytic, the same
# in every plan): on PP-OCR's detector it lifted all-int8 GPTQ weights from 19.4 to 27.5 dB, on its
# classifier from 27.8 to 35.4 dB. On the classifier's int4 GPTQ weights it cost 0.4 dB (12.9 -> 12.6): int8 only.
GPTQ_BC = {"algorithms": {"rounding": "gptq", "bias_correction": True}}
W8_GPTQ = Option("w8g", _weights("int8", "per_channel", weight_only=True, placement="storage", **GPTQ_BC))
# A scale per 32 weights and GPTQ's rounding together: on PP-OCRv4 det's 192x192 1x1 convolutions, alone,
# 43-49 dB on the evaluation crops where w8g gives 34-39 and w8b 33-40, for 1/8 more bytes than w8 (half of fp16's).
W8_BLOCKS_GPTQ = Option("w8bg", _weights("int8", "per_block", weight_only=True, **GPTQ_BC))
W4_GPTQ = Option("w4g", _weights("int4", "per_block", weight_only=True, **GPTQ))
W2 = Option("w2", _weights("int2", "per_block", weight_only=True))

# What each option's short name means, for the result table's legend.
DESCRIPTIONS = {
    "w2": "int2 weights, a scale per 32",
    "w4": "int4 weights, a scale per 32",
    "w4g": "int4 weights, a scale per 32, GPTQ rounding",
    "w8": "int8 weights, a scale per channel",
    "w8g": "int8 weights per channel, GPTQ rounding and bias correction",
    "w8b": "int8 weights, a scale per 32",
    "w8bg": "int8 weights, a scale per 32, GPTQ rounding and bias correction",
    "w8a8": "int8 weights and activations (integer kernels)",
    "w8a16": "int8 weights, int16 activations",
    "fp16": "float16 weights",
    "float": "left float",
}
OPTIONS = {o.name: o for o in (W2, W4, W4_GPTQ, W8, W8_GPTQ, W8_BLOCKS, W8_BLOCKS_GPTQ, W8A8, W8A16, FP16, FLOAT)}
# Measured one node at a time; the others are derived (see qtool.choice.tune.sensitivity).
# int2 is measured too: with 3 levels most weights round to zero, far from the uniform noise that
# would scale int4's error by 49 (derived so, it misled PP-OCR det's allocation: 2.54x at 30 dB,
# against 2.89x with int2 left out).
MEASURED = ("w4", "w4g", "w2", "w8", "w8g", "w8b", "w8bg", "w8a8")  # int2 after int4: it may be skipped


def options_for(target: str) -> list[Option]:
    """The options ``target`` can run, smallest weights first."""
    if target == "tensorrt":
        return [W8A8, FLOAT]
    if target == "cuda":
        return [W2, W4, W4_GPTQ, W8, W8_GPTQ, W8_BLOCKS, W8_BLOCKS_GPTQ, FP16, FLOAT]
    return [W2, W4, W4_GPTQ, W8, W8_GPTQ, W8_BLOCKS, W8_BLOCKS_GPTQ, W8A8, W8A16, FP16, FLOAT]


QUANTIZED_ACTIVATIONS = ("w8a8", "w8a16")  # w8's stored bytes, plus the noise of quantized activations


def for_objective(options: list[Option], timed: bool) -> list[Option]:
    """``options`` less those that can never be the smallest choice when only size counts (``timed`` False).

    w8a8 and w8a16 store the bytes of w8 and add activation noise: they win only on latency, and
    measuring w8a8 costs one model build per node (a seventh of the sensitivity measurement).
    """
    if timed or not any(o.name == "w8" for o in options):
        return options
    return [o for o in options if o.name not in QUANTIZED_ACTIVATIONS]


def without_algorithms(options: list[Option]) -> list[Option]:
    """``options`` less those that need calibration inputs (GPTQ)."""
    return [o for o in options if not (o.entry and "algorithms" in o.entry)]
