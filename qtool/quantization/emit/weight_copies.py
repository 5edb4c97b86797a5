"""Which stored copy of a weight each quantized node reads, and how that copy is turned back into float.

A weight shared by several nodes is quantized and stored once per quantization grid (granularity,
bits, symmetry, float16), whatever placement each node gets: integer kernels read the stored integers
through a DequantizeLinear, storage-placed nodes through a Cast/Mul that onnxruntime folds at load,
weight-only nodes through a DequantizeLinear too. An integer kernel constrains the stored type (uint8
against int16 saturation, or the reduced int8 range), so the copy an integer reader needs is the one
stored and the other readers derive their float values from it. Only readers that ask for different
grids (int4 for one node, int8 for another), or integer readers that need different stored types, get
copies of their own: each is what that reader was configured to compute with.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qtool.numerics.qparams import quant_type
from qtool.quantization.plan.records import NodePlan
from qtool.schemes import NodePlacement, WeightForm

CopyKey = tuple[int | None, int | None, str, bool, str]
# axis, block size, dtype, symmetric, range ("full", "reduced" or "fit" for the kernel's pairs): what the
# stored integers of one copy depend on

"""How a node reads its stored weight (see :class:`WeightUse`)."""
DEQUANTIZED: WeightForm = "dequantized"
RESTORED: WeightForm = "restored"
FP16: WeightForm = "fp16"
INTEGERS: WeightForm = "integers"
GATHERED: WeightForm = "gathered"
NBITS: WeightForm = "matmul_nbits"


@dataclass(frozen=True)
class WeightUse:
    """How one node reads its weight: the stored copy (by key) and the form that restores it."""

    weight: str
    copy: CopyKey
    form: WeightForm  # DEQUANTIZED (DequantizeLinear), RESTORED (Cast/Mul folded at load), FP16 (Cast) or
    # INTEGERS (the stored integers themselves, read by a dynamically quantized MatMulInteger) or
    # GATHERED (the stored rows a Gather reads, dequantized after it) or NBITS (packed into onnxruntime's
    # MatMulNBits, which replaces the MatMul)


def copy_key(node: NodePlan) -> CopyKey:
    """The stored copy ``node`` would need if it were the weight's only reader."""
    assert node.weight is not None  # the callers pass nodes with a weight
    spec = node.scheme.weight
    span = "reduced" if node.reduced_weight_range else "fit" if node.fits_weight_pairs else "full"
    return (node.weight.axis, node.weight.block_size, spec.dtype, spec.symmetric, span)


def _grid(node: NodePlan) -> tuple[object, ...]:
    """The values a copy can represent: equal grids restore to equal floats, whatever the stored type.

    A symmetric signed type in its narrow range and the unsigned type of the same width with the
    zero point in its centre hold the same levels (int8 [-127, 127] and uint8 [1, 255] around 128).
    """
    assert node.weight is not None  # the caller keeps nodes with a weight
    spec = node.scheme.weight
    if spec.fp16:
        return ("fp16",)
    qtype = quant_type(spec.dtype)
    signed = None if spec.symmetric else qtype.signed
    return (node.weight.axis, node.weight.block_size, qtype.bits, spec.symmetric, signed)


# Placements whose kernels read the stored integers, so the stored type is theirs to choose.
_INTEGER_READERS: tuple[NodePlacement, ...] = ("integer", "dynamic")


def weight_uses(nodes: Iterable[NodePlan]) -> dict[str, WeightUse]:
    """Node name -> how it reads its weight, for every node of ``nodes`` with a weight.

    Nodes are taken in order: the first integer reader's copy is the one the other readers of
    the same grid derive from (the first reader's when none is integer).
    """
    by_grid: dict[tuple[str, tuple[object, ...]], list[NodePlan]] = {}
    for node in nodes:
        if node.weight is not None:
            by_grid.setdefault((node.weight.name, _grid(node)), []).append(node)
    uses: dict[str, WeightUse] = {}
    for (weight, _), readers in by_grid.items():
        integer = [copy_key(n) for n in readers if n.placement in _INTEGER_READERS]
        shared = integer[0] if integer else copy_key(readers[0])
        for node in readers:
            if node.scheme.weight.fp16:
                form = FP16
            elif node.placement == "dynamic":
                form = INTEGERS
            elif node.placement == "weight_only" and node.scheme.weight.format == "matmul_nbits":
                form = NBITS
            elif node.placement == "lookup":
                # Rows carry their own scale: dequantized after the Gather. Blocks are restored at load.
                rows = node.weight is not None and node.weight.block_size is None and node.weight.axis in (None, 0)
                form = GATHERED if rows else RESTORED
            else:
                form = RESTORED if node.placement == "storage" else DEQUANTIZED
            own = node.placement in _INTEGER_READERS
            uses[node.name] = WeightUse(weight, copy_key(node) if own else shared, form)
    return uses
