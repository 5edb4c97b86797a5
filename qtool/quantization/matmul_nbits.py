"""Weight-only low-bit MatMul as onnxruntime's ``com.microsoft.MatMulNBits``: grid, packing and node.

``MatMul(A, B)`` with a constant ``B [K, N]`` becomes ``MatMulNBits(A, B_packed, scales[,
zero_points])``: ``B`` is stored column by column (one row per output ``n``) in blocks of
``block_size`` consecutive ``k``, each block with its own scale and zero point, and
``B[k, n] = (code - zero_point) * scale``. Codes are unsigned ``0 .. 2^bits - 1``; without a
zero-point input the op uses ``2^(bits-1)`` (so 4-bit codes stand for -8..7 steps).

Layouts onnxruntime 1.32 accepts (checked by ``tests/unit/test_matmul_nbits.py``):

- ``B``: uint8 ``[N, n_blocks, block_size * bits / 8]``; element ``i`` of a block sits in byte
  ``i * bits // 8`` at bit ``(i * bits) % 8``: the first element in the lowest bits. ``K`` not a
  multiple of ``block_size`` pads the last block (the kernel reads only ``K`` values).
- ``scales``: float32 ``[N, n_blocks]`` (``[N * n_blocks]`` is accepted too). Negative scales work.
- ``zero_points``: uint8 ``[N, ceil(n_blocks * bits / 8)]``, packed like ``B`` within each row.
- ``bits`` 2, 4 or 8; ``block_size`` a power of two >= 16, and <= 256 for 2 bits.

The grid math here is pure numpy; only :func:`make_matmul_nbits` builds protos.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.quantization.qparams import compute_qparams, quant_type

DOMAIN = "com.microsoft"  # the model needs an opset import of this domain, version 1
SUPPORTED_BITS = (2, 4, 8)
MAX_BLOCK_SIZE_2BIT = 256  # onnxruntime 1.32 refuses larger 2-bit blocks
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # 4: the CPU kernel quantizes A to int8 per block


@dataclass(frozen=True)
class NBitsScheme:
    """How a weight is quantized for MatMulNBits: bits, block length along K, and zero points or not."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True  # no zero-point input: every block uses 2^(bits-1)

    def __post_init__(self) -> None:
        check_layout(self.bits, self.block_size)

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    @property
    def default_zero_point(self) -> int:
        return 1 << (self.bits - 1)


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
class BlockGrid:
    """One scale and zero point per block of K and output column, in the weight's own [K, N] orientation."""

    scales: np.ndarray  # float32 [n_blocks, N]
    zero_points: np.ndarray  # int64 [n_blocks, N], in 0 .. 2^bits - 1
    scheme: NBitsScheme

    def expand(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point repeated to [K, N], one per weight element."""
        size = self.scheme.block_size
        return np.repeat(self.scales, size, axis=0)[:k], np.repeat(self.zero_points, size, axis=0)[:k]


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """[K, N] -> [n_blocks, block_size, N], the last block padded with zeros (representable on any grid)."""
    k, n = weight.shape
    padded = np.zeros((block_count(k, block_size) * block_size, n), np.float32)
    padded[:k] = weight
    return padded.reshape(-1, block_size, n)


def _check_weight(weight: np.ndarray) -> np.ndarray:
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise QtoolError(f"a MatMulNBits weight must be [K, N], got shape {w.shape}", hint="keep this node in float")
    if not np.all(np.isfinite(w)):
        raise QtoolError("the weight holds inf or NaN", hint="keep this node in float")
    return w


def rtn_grid(weight: np.ndarray, scheme: NBitsScheme, *, shrink: np.ndarray | float = 1.0) -> BlockGrid:
    """Per-block scale and zero point for round-to-nearest of ``weight [K, N]``.

    Asymmetric: min..max of the block (widened to include 0) over the 2^bits codes. Symmetric
    blocks try two scales and keep the one with the lower squared error: ``amax / (2^(bits-1) - 1)``
    (nothing clips) and, like onnxruntime's own quantizer, ``-extreme / 2^(bits-1)`` with
    ``extreme`` the block's largest-magnitude value, which lands exactly on the lowest code. That
    scale is negative when the extreme is positive; it spends the grid's extra negative step on
    whichever sign is larger and only clips opposite-sign values above 15/16 of it.

    Args:
        weight: the float weight, [K, N].
        scheme: bits, block size, symmetric or not.
        shrink: a factor on each block's range, a scalar or [n_blocks, N] (1.0: the full range).

    Returns:
        The grid, [n_blocks, N].
    """
    w = _check_weight(weight)
    blocks = _blocks(w, scheme.block_size)
    factor = np.broadcast_to(np.asarray(shrink, np.float32), (blocks.shape[0], blocks.shape[2]))
    if not scheme.symmetric:
        qtype = quant_type(f"uint{scheme.bits}")
        qp = compute_qparams(blocks.min(axis=1) * factor, blocks.max(axis=1) * factor, qtype, symmetric=False)
        return BlockGrid(qp.scale, qp.zero_point.astype(np.int64), scheme)
    half = scheme.default_zero_point
    amax = np.abs(blocks).max(axis=1)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
    unclipped = _nonzero_scale(amax * factor / (half - 1), amax)
    full_range = _nonzero_scale(-extreme * factor / half, amax)
    errors = [_block_error(blocks, scale, half, scheme.qmax) for scale in (unclipped, full_range)]
    scales = np.where(errors[1] < errors[0], full_range, unclipped).astype(np.float32)
    return BlockGrid(scales, np.full(scales.shape, half, np.int64), scheme)


def _nonzero_scale(scale: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """``scale`` as float32 with 1.0 for all-zero blocks and no magnitude below float32's smallest normal."""
    scale = np.where(amax > 0, scale, 1.0).astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    return np.where(np.abs(scale) < tiny, np.copysign(tiny, scale), scale).astype(np.float32)


def _block_error(blocks: np.ndarray, scale: np.ndarray, zero: int, qmax: int) -> np.ndarray:
    """Squared rounding error per block ([n_blocks, N]) of [n_blocks, block_size, N] on a symmetric grid."""
    s = scale[:, None, :]
    codes = np.clip(np.rint(blocks / s) + zero, 0, qmax)
    return (((codes - zero) * s - blocks) ** 2).sum(axis=1)


def round_codes(weight: np.ndarray, grid: BlockGrid) -> np.ndarray:
    """Nearest codes of ``weight [K, N]`` on ``grid``: int64 [K, N] in 0 .. 2^bits - 1."""
    w = _check_weight(weight)
    scale, zero = grid.expand(w.shape[0])
    # QuantizeLinear's rounding (half to even, in float32), as gptq.round_nearest; kept here so
    # this module does not depend on the algorithms built on it.
    return np.clip(np.rint(w / scale) + zero, 0, grid.scheme.qmax).astype(np.int64)


def dequantize_codes(codes: np.ndarray, grid: BlockGrid) -> np.ndarray:
    """``(code - zero_point) * scale`` as MatMulNBits computes it: float32 [K, N]."""
    scale, zero = grid.expand(codes.shape[0])
    return ((codes.astype(np.int64) - zero).astype(np.float32) * scale).astype(np.float32)


def fake_quantize(weight: np.ndarray, scheme: NBitsScheme, *, shrink: np.ndarray | float = 1.0) -> np.ndarray:
    """``weight`` rounded to nearest on its own :func:`rtn_grid` and dequantized back to float32."""
    grid = rtn_grid(weight, scheme, shrink=shrink)
    return dequantize_codes(round_codes(weight, grid), grid)


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

    @property
    def n_blocks(self) -> int:
        return block_count(self.k, self.block_size)

    @property
    def blob_size(self) -> int:
        return self.block_size * self.bits // 8

    @property
    def scheme(self) -> NBitsScheme:
        return NBitsScheme(self.bits, self.block_size, self.zero_points is None)


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


def _unpack_rows(packed: np.ndarray, bits: int, length: int) -> np.ndarray:
    """The inverse of :func:`_pack_rows`: uint8 [rows, bytes] -> int64 [rows, length]."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    shifts = np.arange(per_byte, dtype=np.uint8) * np.uint8(bits)
    values = (packed[:, :, None] >> shifts) & np.uint8(mask)
    return values.reshape(packed.shape[0], -1)[:, :length].astype(np.int64)


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
    padded = np.repeat(zero, block_size, axis=0).astype(np.uint8)
    padded[:k] = q  # padding holds the zero point, so it dequantizes to 0 wherever it is read
    per_column = padded.T.reshape(n * blocks, block_size)
    packed = _pack_rows(per_column, bits).reshape(n, blocks, -1)
    packed_zero = None if zero_points is None else _pack_rows(zero.astype(np.uint8).T, bits)
    return NBitsWeight(packed, np.ascontiguousarray(s.T), packed_zero, k, n, bits, block_size, accuracy_level)


def quantize_rtn(weight: np.ndarray, scheme: NBitsScheme, *, accuracy_level: int = 0) -> NBitsWeight:
    """``weight [K, N]`` rounded to nearest on its :func:`rtn_grid` and packed."""
    grid = rtn_grid(weight, scheme)
    zero = None if scheme.symmetric else grid.zero_points
    return pack_codes(
        round_codes(weight, grid), grid.scales, zero, scheme.bits, scheme.block_size, accuracy_level=accuracy_level
    )


def unpack_codes(weight: NBitsWeight) -> np.ndarray:
    """The codes of a packed weight as int64 [K, N]."""
    per_column = _unpack_rows(weight.packed.reshape(weight.n * weight.n_blocks, -1), weight.bits, weight.block_size)
    return per_column.reshape(weight.n, -1)[:, : weight.k].T


def grid_of(weight: NBitsWeight) -> BlockGrid:
    """The scales and zero points of a packed weight in [n_blocks, N] orientation."""
    if weight.zero_points is None:
        zero = np.full((weight.n_blocks, weight.n), 1 << (weight.bits - 1), np.int64)
    else:
        zero = _unpack_rows(weight.zero_points, weight.bits, weight.n_blocks).T
    return BlockGrid(weight.scales.T, zero, weight.scheme)


def dequantize(weight: NBitsWeight) -> np.ndarray:
    """The float32 [K, N] weight MatMulNBits multiplies by: the numpy reference for the op."""
    return dequantize_codes(unpack_codes(weight), grid_of(weight))


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
