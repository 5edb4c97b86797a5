"""Which opset a quantized model is written at.

Four things bound it: the input model's opset, what the config needs (int4 weights need opset 21,
int2 25, fp8 19, per-channel 13), the newest opset at which the installed onnxruntime has
QuantizeLinear/DequantizeLinear kernels for the dtypes the config uses, and the user's ``--opset``.
onnxruntime often loads a newer opset than it has Q/DQ kernels for (1.32 loads opset 28 but has
QuantizeLinear only up to 27), so the kernels themselves are probed, once per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qtool.errors import QtoolError

QDQ_FIRST_OPSET = 10  # QuantizeLinear/DequantizeLinear exist from opset 10

_TYPES = {
    "uint8": TensorProto.UINT8,
    "int8": TensorProto.INT8,
    "uint16": TensorProto.UINT16,
    "int16": TensorProto.INT16,
    "uint4": TensorProto.UINT4,
    "int4": TensorProto.INT4,
    "uint2": TensorProto.UINT2,
    "int2": TensorProto.INT2,
    "fp8_e4m3": TensorProto.FLOAT8E4M3FN,
    "fp8_e5m2": TensorProto.FLOAT8E5M2,
}


def newest_onnx_opset() -> int:
    """The newest default-domain opset the installed onnx defines."""
    return int(onnx.defs.onnx_opset_version())


def _probe_model(dtype: int, opset: int, *, quantize: bool) -> onnx.ModelProto:
    """A one- or two-node model: DequantizeLinear of a constant, or QuantizeLinear then DequantizeLinear."""
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [1.0])
    zero = helper.make_tensor("zero", dtype, [], [0])
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    if quantize:
        nodes = [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
        ]
        inputs, initializers = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], [scale, zero]
    else:
        nodes = [helper.make_node("DequantizeLinear", ["w", "scale", "zero"], ["y"])]
        inputs, initializers = [], [helper.make_tensor("w", dtype, [2], [0, 1]), scale, zero]
    graph = helper.make_graph(nodes, "qdq_probe", inputs, [output], initializers)
    opset_id = helper.make_opsetid("", opset)
    return helper.make_model(graph, opset_imports=[opset_id], ir_version=helper.find_min_ir_version_for([opset_id]))


def _loads(model: onnx.ModelProto) -> bool:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # refusals are the expected answer here
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - onnxruntime's refusals are untyped; any of them means "no kernel"
        return False
    return True


@functools.cache
def qdq_kernel_opset(dtype: str, *, quantize: bool) -> int | None:
    """The newest opset at which onnxruntime's CPU provider has Q/DQ kernels for ``dtype``.

    DequantizeLinear only, or with ``quantize`` QuantizeLinear too; None if neither runs at any opset
    onnx defines.
    """
    for opset in range(newest_onnx_opset(), QDQ_FIRST_OPSET - 1, -1):
        try:
            model = _probe_model(_TYPES[dtype], opset, quantize=quantize)
        except (ValueError, KeyError):  # the dtype does not exist at this opset
            continue
        if _loads(model):
            return opset
    return None


@dataclass(frozen=True)
class RuntimeLimit:
    """The newest opset the installed onnxruntime has Q/DQ kernels for, and the dtype that limits it."""

    opset: int
    dtype: str


def runtime_qdq_limit(activation_dtypes: frozenset[str], weight_dtypes: frozenset[str]) -> RuntimeLimit:
    """The newest opset with Q/DQ kernels for every dtype the config uses.

    Activations are quantized and dequantized at run time; weights are only dequantized.

    Raises:
        QtoolError: onnxruntime has no kernel for one of the dtypes at any opset.
    """
    limit: RuntimeLimit | None = None
    needs = [(d, True) for d in sorted(activation_dtypes)] + [(d, False) for d in sorted(weight_dtypes)]
    for dtype, quantize in needs:
        opset = qdq_kernel_opset(dtype, quantize=quantize)
        if opset is None:
            op = "QuantizeLinear/DequantizeLinear" if quantize else "DequantizeLinear"
            raise QtoolError(
                f"onnxruntime {ort.__version__} has no {op} kernel for {dtype} at any opset",
                hint=f"upgrade onnxruntime, or choose another {'activation' if quantize else 'weight'} dtype",
            )
        if limit is None or opset < limit.opset:
            limit = RuntimeLimit(opset, dtype)
    return limit or RuntimeLimit(newest_onnx_opset(), "")


def choose_opset(
    model_opset: int,
    required: tuple[int, str],
    limit: RuntimeLimit,
    requested: int | None = None,
    *,
    source: str = "the model",
) -> int:
    """The opset to write the quantized model at.

    Without ``requested``: the model's own opset, raised to what the config needs and lowered to what
    onnxruntime has Q/DQ kernels for. With it: exactly ``requested``, if the config and the runtime allow it.

    Raises:
        QtoolError: no opset satisfies all bounds; the message names them and the fix.
    """
    need, why = required
    runtime = f"onnxruntime {ort.__version__} has QuantizeLinear/DequantizeLinear kernels"
    runtime_limit = f"{runtime} for {limit.dtype} only up to opset {limit.opset}"
    if need > limit.opset:
        raise QtoolError(
            f"the config needs opset {need} ({why}), but {runtime_limit}",
            hint="upgrade onnxruntime, or change the config so that it needs a lower opset",
        )
    if requested is not None:
        if requested < need:
            raise QtoolError(
                f"--opset {requested} is below opset {need}, which the config needs ({why})",
                hint=f"use --opset {need} or higher, or change the config",
            )
        if requested > limit.opset:
            raise QtoolError(
                f"--opset {requested} is above what the runtime can run: {runtime_limit}",
                hint=f"use --opset {limit.opset} or lower, or upgrade onnxruntime",
            )
        return requested
    if model_opset > limit.opset:
        return limit.opset  # lowered by onnx's version converter; refused there if it cannot
    return max(model_opset, need)
