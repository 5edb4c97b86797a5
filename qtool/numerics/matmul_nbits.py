"""Weight-only low-bit MatMul as onnxruntime's ``com.microsoft.MatMulNBits``: grid, packing and node.

``MatMul(A, B)`` with a constant ``B [K, N]`` becomes ``MatMulNBits(A, B_packed, scales[,
zero_points])``: ``B`` is stored column by column (one row per output ``n``) in blocks of
``block_size`` consecutive ``k``, each block with its own scale and zero point, and
``B[k, n] = (code - zero_point) * scale``. Codes are unsigned ``0 .. 2^bits - 1``; without a
zero-point input the op uses ``2^(bits-1)`` (so 4-bit codes stand for -8..7 steps).

Layouts onnxruntime 1.32 accepts (checked by ``tests/numerics/test_matmul_nbits.py``):

- ``B``: uint8 ``[N, n_blocks, block_size * bits / 8]``; element ``i`` of a block sits in byte
  ``i * bits // 8`` at bit ``(i * bits) % 8``: the first element in the lowest bits. ``K`` not a
  multiple of ``block_size`` pads the last block (the kernel reads only ``K`` values).
- ``scales``: float32 ``[N, n_blocks]`` (``[N * n_blocks]`` is accepted too). Negative scales work.
- ``zero_points``: uint8 ``[N, ceil(n_blocks * bits / 8)]``, packed like ``B`` within each row.
- ``bits`` 2, 4 or 8; ``block_size`` a power of two >= 16, and <= 256 for 2 bits.

The codes and their grid come from the rewrite (nearest, GPTQ or AdaRound rounding on the weight's
qparams); packing here is pure numpy, and only :func:`make_matmul_nbits` builds protos.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from qtool.errors import QtoolError

DOMAIN = "com.microsoft"  # the model needs an opset import of this domain, version 1
SUPPORTED_BITS = (2, 4, 8)
MAX_BLOCK_SIZE_2BIT = 256  # onnxruntime 1.32 refuses larger 2-bit blocks
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # 4: the CPU kernel quantizes A to int8 per block


def check_layout(bits: int, block_size: int) -> None:
    """Refuse a bit width or block size onnxruntime's MatMulNBits does not run."""
    if bits not in SUPPORTED_BITS:
        raise QtoolError(
            f"MatMulNBits cannot store {bits}-bit weights",
            hint=f"choose bits from {', '.join(map(str, SUPPORTED_BITS))}",
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise QtoolError(
            f"MatMulNBits block_size {block_size} is not a power of two >= 16",
            hint="choose a block size such as 32, 64 or 128",
        )
    if bits == 2 and block_size > MAX_BLOCK_SIZE_2BIT:
        raise QtoolError(
            f"2-bit MatMulNBits block_size {block_size} is over {MAX_BLOCK_SIZE_2BIT}",
            hint=f"choose a block size of at most {MAX_BLOCK_SIZE_2BIT}",
        )


def block_count(k: int, block_size: int) -> int:
    """Blocks along K, the last one padded."""
    return -(-k // block_size)


@dataclass(frozen=True, eq=False)
class NBitsWeight:
    """A [K, N] MatMul weight in MatMulNBits' storage layout, ready to become initializers."""

    packed: np.ndarray  # uint8 [N, n_blocks, block_size * bits / 8]
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray | None  # uint8 [N, ceil(n_blocks * bits / 8)]; None: 2^(bits-1) everywhere
    k: int
    n: int
    bits: int
    block_size: int
    accuracy_level: int = 0  # 0: float compute; 4: A quantized to int8 by the CPU kernel


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[rows, L] integers -> uint8 [rows, ceil(L * bits / 8)]: the first value in the lowest bits."""
    per_byte = 8 // bits
    rows, length = values.shape
    padded = np.zeros((rows, block_count(length, per_byte) * per_byte), np.uint8)
    padded[:, :length] = values
    grouped = padded.reshape(rows, -1, per_byte)
    packed = np.zeros(grouped.shape[:2], np.uint8)
    for position in range(per_byte):
        packed |= grouped[:, :, position] << np.uint8(bits * position)
    return packed


def pack_codes(
    codes: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    bits: int,
    block_size: int,
    *,
    accuracy_level: int = 0,
) -> NBitsWeight:
    """Pack integer codes chosen elsewhere (nearest, GPTQ, AWQ) into MatMulNBits' layout.

    Args:
        codes: unsigned codes of ``B``, [K, N], each in 0 .. 2^bits - 1 (signed codes: add 2^(bits-1)).
        scales: float32 [n_blocks, N]: one per block of K and output column.
        zero_points: [n_blocks, N] in 0 .. 2^bits - 1, or None for the op's default 2^(bits-1).
        bits: 2, 4 or 8.
        block_size: the block length along K: a power of two >= 16.
        accuracy_level: the op's compute precision attribute (0 float, 4 int8 activations).

    Returns:
        The packed weight.
    """
    check_layout(bits, block_size)
    if accuracy_level not in ACCURACY_LEVELS:
        raise QtoolError(
            f"MatMulNBits accuracy_level {accuracy_level} is not one of {ACCURACY_LEVELS}", hint="use 0 or 4"
        )
    q = np.asarray(codes)
    if q.ndim != 2 or not np.issubdtype(q.dtype, np.integer):
        raise QtoolError(f"MatMulNBits codes must be integers [K, N], got {q.dtype} of shape {q.shape}")
    k, n = q.shape
    blocks = block_count(k, block_size)
    qmax = (1 << bits) - 1
    if q.size and (q.min() < 0 or q.max() > qmax):
        raise QtoolError(
            f"{bits}-bit codes must lie in 0..{qmax}, got {q.min()}..{q.max()}",
            hint=f"signed codes need {1 << (bits - 1)} added first",
        )
    s = np.asarray(scales, np.float32)
    if s.shape != (blocks, n):
        raise QtoolError(f"scales of shape {s.shape} do not fit a [{k}, {n}] weight in blocks of {block_size}")
    zero = np.full((blocks, n), 1 << (bits - 1), np.int64) if zero_points is None else np.asarray(zero_points)
    if zero.shape != (blocks, n) or (zero.size and (zero.min() < 0 or zero.max() > qmax)):
        raise QtoolError(
            f"zero points of shape {zero.shape} must be [{blocks}, {n}] with values in 0..{qmax}",
            hint="pass None for the default zero point",
        )
    padded = np.repeat(zero.astype(np.uint8), block_size, axis=0)
    padded[:k] = q  # padding holds the zero point, so it dequantizes to 0 wherever it is read
    per_column = padded.T.reshape(n * blocks, block_size)
    packed = _pack_rows(per_column, bits).reshape(n, blocks, -1)
    packed_zero = None if zero_points is None else _pack_rows(zero.astype(np.uint8).T, bits)
    return NBitsWeight(packed, np.ascontiguousarray(s.T), packed_zero, k, n, bits, block_size, accuracy_level)


@dataclass(frozen=True, eq=False)
class MatMulNBitsNode:
    """A MatMulNBits node and the initializers it reads."""

    node: NodeProto
    initializers: tuple[TensorProto, ...]


def make_matmul_nbits(
    weight: NBitsWeight, input_name: str, output_name: str, *, prefix: str, node_name: str = ""
) -> MatMulNBitsNode:
    """The node computing ``input @ dequantize(weight)`` and its initializers named ``{prefix}_Q{bits}`` etc.

    ``accuracy_level`` 0 is left out of the attributes: it is the default, and some execution
    providers reject the attribute.
    """
    tensors = [
        numpy_helper.from_array(weight.packed, f"{prefix}_Q{weight.bits}"),
        numpy_helper.from_array(weight.scales, f"{prefix}_scales"),
    ]
    if weight.zero_points is not None:
        tensors.append(numpy_helper.from_array(weight.zero_points, f"{prefix}_zero_points"))
    attributes: dict[str, Any] = {"K": weight.k, "N": weight.n, "bits": weight.bits, "block_size": weight.block_size}
    if weight.accuracy_level:
        attributes["accuracy_level"] = weight.accuracy_level
    node = helper.make_node(
        "MatMulNBits",
        [input_name, *(t.name for t in tensors)],
        [output_name],
        name=node_name or f"{prefix}_MatMulNBits",
        domain=DOMAIN,
        **attributes,
    )
    return MatMulNBitsNode(node, tuple(tensors))
