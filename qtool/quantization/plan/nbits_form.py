"""When a weight-only MatMul weight is written as MatMulNBits: where ``weight.format`` asks, and where QDQ would break.

MatMulNBits holds 2-D MatMul/Gemm weights in blocks along K. With ``weight.format: qdq`` onnxruntime
turns a block-wise ``DequantizeLinear`` before a MatMul (or a Gemm reading a [K, N] weight) into
MatMulNBits itself at load; for 2-bit weights whose output columns are not a multiple of 4 that fusion
(onnxruntime 1.32, measured) repacks the bytes wrongly: the model computes garbage, different in every
session. Written as MatMulNBits by qtool (which packs each column on its own) the same weights run the
same kernel correctly.
"""

from __future__ import annotations

from onnx import NodeProto, helper

from qtool.errors import QtoolError
from qtool.graph.index import GraphView
from qtool.numerics.matmul_nbits import check_layout
from qtool.numerics.qparams import quant_type
from qtool.quantization.plan.records import WeightPlan
from qtool.schemes import NodeScheme

INT2_PACKED_COLUMNS = 4  # 2-bit values per byte: a [K, N] weight whose N is not a multiple splits rows in bytes


def nbits_fallback(node: NodeProto, weight: WeightPlan, scheme: NodeScheme, g: GraphView) -> str | None:
    """Why ``weight.format: matmul_nbits`` falls back to QDQ for ``node`` (None: it is written as MatMulNBits).

    Raises:
        QtoolError: a MatMul weight the op cannot hold (not blocks along K, or an unsupported layout).
    """
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type not in ("MatMul", "Gemm") or node.input[1] != weight.name or g.rank(weight.name) != 2:
        return "MatMulNBits holds 2-D MatMul/Gemm weights only: written as QDQ"
    if node.op_type == "Gemm" and (
        attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1 or attrs.get("beta", 1.0) != 1
    ):
        return "MatMulNBits cannot hold a Gemm with transA, alpha or beta: written as QDQ"
    reduction = 1 if node.op_type == "Gemm" and attrs.get("transB", 0) else 0
    if weight.block_size is None or weight.axis != reduction:
        raise QtoolError(
            f"node {node.name}: weight.format matmul_nbits stores the weight in blocks along K",
            hint=f"set weight granularity: per_block with axis null (rule {scheme.rule})",
        )
    try:
        check_layout(quant_type(scheme.weight.dtype).bits, weight.block_size)
    except QtoolError as e:
        raise QtoolError(
            f"node {node.name}: {e.message}", hint=f"{e.hint or 'see weight.format'} (rule {scheme.rule})"
        ) from None
    return None


def int2_fusion_fault(node: NodeProto, weight: WeightPlan, scheme: NodeScheme, g: GraphView) -> str | None:
    """Why a QDQ 2-bit block-wise MatMul (or Gemm) weight is written as MatMulNBits instead (None: QDQ is sound).

    onnxruntime fuses it into MatMulNBits at load and, where the output columns are not a multiple
    of :data:`INT2_PACKED_COLUMNS`, corrupts it; qtool's own MatMulNBits is the kernel that fusion means.
    """
    spec = scheme.weight
    two_bit = spec.dtype in ("int2", "uint2") and spec.format in (None, "qdq")
    if node.op_type not in ("MatMul", "Gemm") or not two_bit:
        return None
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        return None  # an [N, K] weight: onnxruntime leaves it to Gemm (measured right)
    dims = list(g.initializers[weight.name].dims) if weight.name in g.initializers else []
    if len(dims) != 2 or dims[1] % INT2_PACKED_COLUMNS == 0 or weight.block_size is None or weight.axis != 0:
        return None
    try:
        if nbits_fallback(node, weight, scheme, g) is not None:
            return None
    except QtoolError:  # a layout MatMulNBits cannot hold: onnxruntime does not fuse it either
        return None
    return (
        f"written as MatMulNBits: onnxruntime's fusion of a 2-bit DequantizeLinear into MatMul corrupts "
        f"weights whose {dims[1]} output columns are not a multiple of {INT2_PACKED_COLUMNS}"
    )
