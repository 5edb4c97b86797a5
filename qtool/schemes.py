"""The resolved quantization settings of a node, and how a target changes them.

Records, built by :meth:`qtool.config.QConfig.resolve` from the config's validated document:
each value comes from the config (configs/default.yaml under the user's file), none is defaulted here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

# One word per concept, each defined once (mypy's strict equality checks every comparison against them).
RulePlacement = Literal["auto", "integer", "storage"]
"""What a config rule asks of a node: integer kernels, storage-only compression, or decided per node."""
NodePlacement = Literal["integer", "dynamic", "storage", "weight_only", "lookup"]
"""How a planned node runs: integer kernels (Q/DQ), inputs quantized at run time, weights restored to float
at load, weight-only (4/2-bit or fp16 weights, float activations), or a Gather reading dequantized rows."""
NodeKind = Literal["integer", "dynamic", "storage", "weight_only", "lookup", "chained"]
"""How a planned node runs, for counts and reports: its placement, or "chained" for an unweighted op between
integer kernels (see qtool.quantization.plan.chains)."""
AutoPlacement = Literal["integer", "storage", "dynamic"]
"""What the placement choice makes of every node a rule placed "auto", one candidate each."""
Rounding = Literal["nearest", "gptq", "adaround"]
"""How weights are rounded onto their grid: to nearest, or minimising the output error on calibration inputs."""
CandidateName = RulePlacement | AutoPlacement | Literal["unchained", "search"]
"""The placement choice's candidates: the rules' placement ("auto"), auto with its chained ops float, every node
an integer kernel, every weight stored (float compute), dynamic int8 MatMul/Gemm, and the search's mixed placement."""
Granularity = Literal["per_tensor", "per_channel", "per_block"]
"""How a tensor's scales are shared: one for the tensor, one per channel, or one per block of a channel."""
WeightFormat = Literal["qdq", "matmul_nbits"]
"""How low-bit weights are written: DequantizeLinear (QDQ), or onnxruntime's MatMulNBits (MatMul only)."""
Mode = Literal["static", "dynamic"]
"""Static activation ranges from calibration, or integer MatMul/Gemm quantizing their inputs at run time."""
WeightForm = Literal["dequantized", "restored", "fp16", "integers", "gathered", "matmul_nbits"]
"""How a stored weight copy is read back (see qtool.quantization.emit.weight_copies)."""
PairGuard = Literal["int8", "int8 fitted", "int8 (exact kernel)", "uint8", "int8 reduced", "int8 unguarded"]
"""How an integer kernel's 8-bit weight was stored against int16 pair saturation, as the reports name it
(their ``weight_forms``; see qtool.numerics.saturation). Not a WeightForm, which says how a copy is read back."""
CacheGranularity = Literal["per_tensor", "per_channel"]
"""How a decoder's int8 key/value cache is scaled (``kv_cache.granularity``)."""
Target = Literal["cpu", "cpu_vnni", "cuda", "tensorrt"]
"""Where the model will run: its rules decide what quantize writes (see :func:`for_target`)."""
SaturationSetting = Literal["auto", "uint8", "reduce_range", "ignore"]
"""``weight.saturation`` as a config writes it."""
Saturation = SaturationSetting | Literal["fit"]
"""A setting, or ``fit``: what ``auto`` becomes for a node whose int8 weight pairs are fitted to the AVX2 limit
(see qtool.numerics.saturation)."""


@dataclass(frozen=True)
class TensorScheme:
    """How one tensor role (weight or activation) is quantized."""

    dtype: str
    granularity: Granularity
    symmetric: bool
    # The rest applies to one role only; None where it does not apply. The values come from the
    # config (configs/default.yaml and the user's file): see qtool.schemas.config for each key.
    block_size: int | None = None  # per_block only
    axis: int | None = None  # overrides the op's natural channel / block axis
    observer: str | dict[str, Any] | None = None  # activations: overrides calibration.observer
    saturation: Saturation | None = None  # weights (see quantization.plan.guard_saturation)
    final_layer_int8: bool | None = None  # weights: a weight-only final projection keeps int8 when 4/2-bit is asked
    format: WeightFormat | None = (
        None  # weights: qdq (DequantizeLinear) | matmul_nbits (onnxruntime's MatMulNBits, MatMul only)
    )
    accuracy_level: int | None = None  # weights, matmul_nbits: the op's compute precision (0 float, 4 int8 activations)

    @property
    def per_channel(self) -> bool:
        return self.granularity == "per_channel"

    @property
    def per_block(self) -> bool:
        return self.granularity == "per_block"

    @property
    def fp16(self) -> bool:
        return self.dtype == "fp16"

    @property
    def fp8(self) -> bool:
        """float8 values (``fp8_e4m3``, ``fp8_e5m2``): symmetric, stored as QDQ, no integer kernel on CPU."""
        return self.dtype.startswith("fp8_")

    def describe(self) -> str:
        """Short text such as ``int4 per_block(32) sym``."""
        if self.fp16:
            return "fp16"
        granularity = f"per_block({self.block_size})" if self.per_block else self.granularity
        return f"{self.dtype} {granularity} {'sym' if self.symmetric else 'asym'}"


@dataclass(frozen=True)
class Algorithms:
    """The accuracy algorithms a node gets (see :mod:`qtool.quantization.algorithms`)."""

    rounding: Rounding
    bias_correction: bool  # cancel the mean output shift the rounded weight causes
    equalization: bool  # cross-layer equalization of Conv chains, before calibration
    smoothquant: bool  # move activation outliers into MatMul/Gemm weights, before calibration
    smoothquant_alpha: float  # SmoothQuant's migration strength
    awq: bool  # scale weight-only MatMul/Gemm input channels by their activations, before quantizing

    @property
    def need_inputs(self) -> bool:
        """Whether the node's calibration inputs (Hessian, mean patch) are needed."""
        return self.rounding != "nearest" or self.bias_correction

    def names(self) -> list[str]:
        """The algorithms turned on, as short names (``gptq``, ``bias_correction``...)."""
        names: list[str] = [self.rounding] if self.rounding != "nearest" else []
        names += [name for name in ("bias_correction", "equalization", "smoothquant", "awq") if getattr(self, name)]
        return names


@dataclass(frozen=True)
class NodeScheme:
    """The resolved quantization settings of one node, and the rule that decided them."""

    weight: TensorScheme
    activation: TensorScheme
    weight_only: bool
    rule: str  # global, op_type:<type>, node_name:<pattern>, ... (see QConfig.resolve)
    placement: RulePlacement
    algorithms: Algorithms
    mode: Mode  # "dynamic": integer MatMul/Gemm quantize their inputs at run time


@dataclass(frozen=True)
class CalibrationSettings:
    """How ``calibrate`` walks the dataset."""

    observer: str
    batch_size: int
    limit: int | None
    observer_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AccuracyOptions:
    """The `accuracy:` section: the target of the placement choice and the budgets of its sensitivity search."""

    target_sqnr_db: float | None  # None: no search
    max_float_nodes: int
    samples: int  # spread evenly over the data set
    search_seconds: float  # the search stops trying nodes after this long
    latency_runs: int  # interleaved timing rounds per candidate placement (0: placement by the MAC model)
    outputs: tuple[str, ...] = ()  # the outputs the target judges, by name or re: pattern (empty: see judged)
    state: tuple[tuple[str, str], ...] = ()  # (output, the input it feeds back): a streaming model's state, as given


TARGETS: tuple[Target, ...] = get_args(Target)
# onnxruntime's CPU kernels: placement by measurement, CPU kernel predictions
CPU_TARGETS: tuple[Target, ...] = ("cpu", "cpu_vnni")


def for_target(scheme: NodeScheme, target: str) -> NodeScheme:
    """``scheme`` as ``target`` runs it.

    * ``cpu``: as configured.
    * ``cpu_vnni``: as configured, for CPUs whose uint8 x int8 kernels cannot saturate (x86 with VNNI, ARM):
      ``weight.saturation: auto`` keeps full-range int8 weights unfitted (``ignore``).
    * ``cuda``: onnxruntime's CUDA provider has no integer kernels for Q/DQ models (it dequantizes and
      runs float), so ``placement: auto`` stores weights quantized and restores them at load.
    * ``tensorrt``: TensorRT runs int8 only with symmetric int8 on both inputs of a layer, so
      activations become int8 with zero point 0, int8 weights symmetric (full range: GPUs do not
      saturate like VNNI-less CPUs), and every auto or storage node an integer one (a weight
      restored to float only costs time there). Weight-only nodes stay weight-only. fp8
      activations and weights stay fp8 (TensorRT fuses fp8_e4m3 Q/DQ into fp8 layers the same way).
    """
    if target == "cpu_vnni" and scheme.weight.saturation == "auto":
        return replace(scheme, weight=replace(scheme.weight, saturation="ignore"))
    if target == "cuda" and scheme.placement == "auto" and not scheme.weight_only:
        return replace(scheme, placement="storage", rule=scheme.rule)
    if target != "tensorrt":
        return scheme
    dtype = scheme.activation.dtype if scheme.activation.fp8 else "int8"
    activation = replace(scheme.activation, dtype=dtype, symmetric=True)
    weight = scheme.weight
    if not weight.fp16 and not weight.fp8:
        signed = {"uint8": "int8", "uint4": "int4", "uint2": "int2"}.get(weight.dtype, weight.dtype)
        weight = replace(weight, dtype=signed, symmetric=True, saturation="ignore")
    placement = scheme.placement if scheme.weight_only else "integer"
    return replace(scheme, activation=activation, weight=weight, placement=placement)
