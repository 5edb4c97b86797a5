"""Per-node input statistics for weight algorithms: the patch Hessian and the mean patch.

A "patch" is what one output position of a node multiplies by a row of its weight:
for Conv the ``Cin/group x kernel`` window in (channel, kernel...) order, for MatMul and
Gemm one row of the input along the reduction axis. GPTQ needs ``H = sum x_patch x_patch^T``
(estimated on a seeded subsample of positions, so its cost is bounded); bias correction
needs the exact mean patch ``E[x_patch]`` over every position, padding zeros included,
which per-tap strided window sums give without building the full im2col matrix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np

from qtool.errors import QtoolError

DEFAULT_MAX_POSITIONS = 4096


@dataclass(frozen=True)
class ConvGeometry:
    """A Conv node's window: ONNX attributes, with ``pads`` as (begins..., ends...)."""

    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    pads: tuple[int, ...] | None = None
    dilations: tuple[int, ...] | None = None
    group: int = 1
    auto_pad: str = "NOTSET"

    @classmethod
    def from_attributes(cls, attributes: dict[str, object], weight_shape: tuple[int, ...]) -> ConvGeometry:
        """Geometry from a Conv node's attribute values (``onnx.helper.get_attribute_value``)."""
        auto_pad = attributes.get("auto_pad", "NOTSET")
        if isinstance(auto_pad, bytes):
            auto_pad = auto_pad.decode()

        def ints(name: str) -> tuple[int, ...] | None:
            value = attributes.get(name)
            return None if value is None else tuple(int(v) for v in value)  # type: ignore[attr-defined]

        return cls(
            kernel_shape=ints("kernel_shape") or tuple(weight_shape[2:]),
            strides=ints("strides"),
            pads=ints("pads"),
            dilations=ints("dilations"),
            group=int(attributes.get("group", 1)),  # type: ignore[call-overload]
            auto_pad=str(auto_pad),
        )

    def resolved(self, spatial: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Strides, dilations and (begins..., ends...) pads for an input of ``spatial`` size."""
        rank = len(self.kernel_shape)
        if len(spatial) != rank:
            raise QtoolError(
                f"Conv input has {len(spatial)} spatial dimensions but the kernel has {rank}",
                hint="the calibration input does not match the model's Conv geometry",
            )
        strides = self.strides or (1,) * rank
        dilations = self.dilations or (1,) * rank
        if self.auto_pad in ("NOTSET", ""):
            return strides, dilations, self.pads or (0,) * (2 * rank)
        if self.auto_pad == "VALID":
            return strides, dilations, (0,) * (2 * rank)
        if self.auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
            raise QtoolError(f"unknown Conv auto_pad '{self.auto_pad}'", hint="the model is not valid ONNX")
        begins, ends = [], []
        for size, k, s, d in zip(spatial, self.kernel_shape, strides, dilations, strict=True):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2
            begins.append(small if self.auto_pad == "SAME_UPPER" else large)
            ends.append(total - begins[-1])
        return strides, dilations, (*begins, *ends)


@dataclass(frozen=True)
class MatMulGeometry:
    """A MatMul/Gemm input: the axis it is reduced along (-1 for MatMul's A, 0 for Gemm with transA)."""

    reduction_axis: int = -1


Geometry: TypeAlias = "ConvGeometry | MatMulGeometry"


@dataclass(frozen=True, eq=False)
class InputStats:
    """Sums of patch outer products and of patches, per weight group, with their counts.

    Sums (not means) are kept so that shards merge exactly: merging adds sums and counts.
    The Hessian comes from a subsample of positions and the mean from all of them, hence
    two counts.
    """

    hessian_sum: np.ndarray  # float64 [groups, K, K]
    hessian_count: int
    mean_sum: np.ndarray  # float64 [groups, K]
    mean_count: int

    def hessian(self) -> np.ndarray:
        """``E[x_patch x_patch^T]`` per group, [groups, K, K] (zeros when nothing was seen)."""
        return self.hessian_sum / max(self.hessian_count, 1)

    def mean(self) -> np.ndarray:
        """``E[x_patch]`` per group, [groups, K]."""
        return self.mean_sum / max(self.mean_count, 1)

    def merge(self, other: InputStats) -> InputStats:
        """The statistics of both shards together."""
        self._check_shapes(other)
        return InputStats(
            self.hessian_sum + other.hessian_sum,
            self.hessian_count + other.hessian_count,
            self.mean_sum + other.mean_sum,
            self.mean_count + other.mean_count,
        )

    def in_float64(self) -> InputStats:
        """These statistics with a float64 Hessian sum (a batch's is float32 until it is added up)."""
        if self.hessian_sum.dtype == np.float64:
            return self
        return replace(self, hessian_sum=self.hessian_sum.astype(np.float64))

    def accumulated(self, other: InputStats) -> InputStats:
        """Like :meth:`merge`, adding ``other``'s sums into this one's arrays: for a collector's own running sums.

        The same sums as :meth:`merge` without a new [groups, K, K] array per batch (a large Conv's is tens of MB);
        this object's arrays are the result's, so it must not be read as it was afterwards. ``other``'s Hessian
        sum may be a batch's float32 one: it is added in float64.
        """
        self._check_shapes(other)
        np.add(self.hessian_sum, other.hessian_sum, out=self.hessian_sum)
        np.add(self.mean_sum, other.mean_sum, out=self.mean_sum)
        return InputStats(
            self.hessian_sum,
            self.hessian_count + other.hessian_count,
            self.mean_sum,
            self.mean_count + other.mean_count,
        )

    def _check_shapes(self, other: InputStats) -> None:
        if self.hessian_sum.shape != other.hessian_sum.shape or self.mean_sum.shape != other.mean_sum.shape:
            raise QtoolError(
                f"cannot merge input statistics of shapes {self.hessian_sum.shape} and {other.hessian_sum.shape}",
                hint="the shards were collected from different models or node geometries",
            )


def sample_positions(total: int, max_positions: int, seed: int | np.random.Generator) -> np.ndarray:
    """Sorted indices of at most ``max_positions`` of ``total`` positions, drawn without replacement."""
    if total <= max_positions:
        return np.arange(total)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(total, size=max_positions, replace=False))


def input_stats(
    x: np.ndarray,
    geometry: Geometry,
    *,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    seed: int | np.random.Generator = 0,
    means: bool = True,
    batch_sums: bool = False,
) -> InputStats:
    """The input statistics of one batch ``x`` of a node's float input.

    Args:
        x: the node's data input: [N, C, *spatial] for Conv, any rank for MatMul/Gemm.
        geometry: how the node turns its input into patches.
        max_positions: at most this many output positions (drawn before gathering) enter the Hessian.
        seed: seed or generator for that draw.
        means: whether a Conv's mean patch is summed too (bias correction needs it, GPTQ does not: for a
            Conv it reads the whole input once per kernel tap); without it the mean stays empty (count 0).
        batch_sums: leave the Hessian sum float32, as the product gave it, for a collector that adds it into its
            float64 running sums (:meth:`InputStats.accumulated`: the same sums, without a float64 copy per batch).

    Returns:
        Statistics to merge with those of other batches.
    """
    if isinstance(geometry, MatMulGeometry):
        stats = _matmul_stats(np.asarray(x), geometry, max_positions, seed)
    else:
        stats = _conv_stats(np.asarray(x), geometry, max_positions, seed, means)
    return stats if batch_sums else stats.in_float64()


def _hessian(patches: np.ndarray) -> np.ndarray:
    """[P, G, K] patches -> [G, K, K] sums of outer products, as float32.

    The product runs in float32 BLAS (twice as fast as float64, and this is the costly step);
    one batch sums at most ``max_positions`` products, and batches add up in float64.
    """
    by_group = np.ascontiguousarray(patches.transpose(1, 0, 2), dtype=np.float32)
    return by_group.transpose(0, 2, 1) @ by_group


def _matmul_stats(
    x: np.ndarray, geometry: MatMulGeometry, max_positions: int, seed: int | np.random.Generator
) -> InputStats:
    rows = np.moveaxis(x, geometry.reduction_axis, -1).reshape(-1, x.shape[geometry.reduction_axis])
    chosen = rows[sample_positions(len(rows), max_positions, seed)]
    return InputStats(
        hessian_sum=_hessian(chosen[:, None, :]),
        hessian_count=len(chosen),
        mean_sum=rows.sum(axis=0, dtype=np.float64)[None, :],
        mean_count=len(rows),
    )


def _conv_stats(
    x: np.ndarray, geometry: ConvGeometry, max_positions: int, seed: int | np.random.Generator, means: bool = True
) -> InputStats:
    batch, channels, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    group = geometry.group
    if channels % group:
        raise QtoolError(f"Conv input has {channels} channels, not a multiple of group={group}")
    strides, dilations, pads = geometry.resolved(spatial)
    rank = len(spatial)
    padded = np.pad(x, [(0, 0), (0, 0), *zip(pads[:rank], pads[rank:], strict=True)])
    kernel = geometry.kernel_shape
    out = tuple(
        (size - d * (k - 1) - 1) // s + 1
        for size, k, s, d in zip(padded.shape[2:], kernel, strides, dilations, strict=True)
    )
    if min(out) <= 0:
        raise QtoolError(f"Conv window {kernel} does not fit its padded input {padded.shape[2:]}")
    taps = np.array(list(itertools.product(*(range(k) for k in kernel))), dtype=np.int64).reshape(-1, rank)

    # Hessian: gather only the sampled positions' windows, [P, taps, C].
    chosen = sample_positions(batch * int(np.prod(out)), max_positions, seed)
    sample, *position = np.unravel_index(chosen, (batch, *out))
    channels_last = np.moveaxis(padded, 1, -1)
    coords = [position[i][:, None] * strides[i] + taps[None, :, i] * dilations[i] for i in range(rank)]
    index = (sample[:, None], *coords)
    windows = channels_last[index]
    patches = windows.transpose(0, 2, 1).reshape(len(chosen), group, -1)  # (channel, taps) order per group

    if means:
        tap_sums = _tap_sums(padded, kernel, (strides, dilations), out)
    else:
        tap_sums = np.zeros((channels, len(taps)), np.float64)
    return InputStats(
        hessian_sum=_hessian(patches),
        hessian_count=len(chosen),
        mean_sum=tap_sums.reshape(group, -1),
        mean_count=batch * int(np.prod(out)) if means else 0,
    )


MANY_TAPS = 64  # past this many taps along an axis, they are summed through one strided view, not one call each


def _tap_sums(
    padded: np.ndarray,
    kernel: tuple[int, ...],
    steps: tuple[tuple[int, ...], tuple[int, ...]],
    out: tuple[int, ...],
) -> np.ndarray:
    """For each channel and kernel tap, the sum of the inputs that tap reads at every output position: [C, taps].

    ``steps``: the strides and dilations. A tap's positions are a product of one strided line per spatial axis, so
    its sum is taken one axis at a time, the last (contiguous) axis first with the batch: each of its taps reads the
    input once, and the axes after work on those far smaller sums (a 3x3 kernel reads the input 3 times, not 9; a
    400-tap audio kernel at stride 160 reads each sample 2.5 times).
    """
    strides, dilations = steps
    sums: np.ndarray = padded
    for axis in reversed(range(len(kernel))):
        k, s, d, o = kernel[axis], strides[axis], dilations[axis], out[axis]
        first = sums is padded  # the input itself: its batch axis is summed too
        dim = 2 + axis if first else 1 + axis  # [N, C, *spatial] first, then [C, *spatial..., *kernel axes]
        reduced = (0, dim) if first else dim
        lead = [slice(None)] * dim
        if k > MANY_TAPS:  # one strided view [..., out, taps] of the axis, summed over the positions in one call
            view = np.lib.stride_tricks.sliding_window_view(sums, (k - 1) * d + 1, axis=dim)
            view = view[tuple([*lead, slice(None, (o - 1) * s + 1, s)])][..., ::d]
            sums = np.moveaxis(view.sum(axis=reduced, dtype=np.float64), -1, 1 + axis)
            continue
        lines = [
            sums[tuple([*lead, slice(t * d, t * d + (o - 1) * s + 1, s)])].sum(axis=reduced, dtype=np.float64)
            for t in range(k)
        ]
        sums = np.stack(lines, axis=1 + axis)
    return sums.reshape(padded.shape[1], -1)
