"""AWQ: scale a low-bit weight's input channels by how large their activations are (Lin et al., 2023).

For ``Y = X W`` (``W [K, N]`` quantized blockwise along K) the error a weight row adds to
``Y`` is its rounding error times its input: rows read by large activations matter most.
Multiplying row ``k`` by ``s_k > 1`` and dividing input channel ``k`` by it leaves ``Y``
unchanged in exact arithmetic, but makes that row a larger share of its block's range, so it
is rounded with a smaller relative error (the block's other rows pay a little). AWQ searches
``s = mean|x|^alpha`` (normalised so its largest and smallest entries are reciprocal) over
``alpha`` in ``[0, 1)`` and keeps the ``alpha`` whose quantized layer is closest to the float
one on a sample of calibration inputs. ``alpha = 0`` is plain round-to-nearest, so the chosen
scales are never worse than it on that sample.

:func:`awq_clip` is AWQ's second step: per block and output column it shrinks the range by
factors ``1.0 .. max_shrink`` and keeps the one with the lowest output error, trading a clipped
outlier weight for finer steps on the rest.

Several MatMuls that read the same activation must share ``s`` (the activation is divided
once): pass their weights concatenated along N. The caller folds ``1 / s`` into the
activation's producer or inserts a Mul; this module only computes numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.errors import QtoolError
from qtool.quantization.matmul_nbits import (
    NBitsScheme,
    NBitsWeight,
    block_count,
    dequantize,
    fake_quantize,
    pack_codes,
    round_codes,
    rtn_grid,
)

DEFAULT_GRID = 20
DEFAULT_MAX_SHRINK = 0.5  # clipping tries ranges down to just above half the block's own
MEAN_FLOOR = 1e-4  # channels quieter than this fraction of the loudest are treated as this loud


@dataclass(frozen=True, eq=False)
class AwqScales:
    """The per-input-channel scales AWQ chose, and the sample's output error with and without them."""

    scales: np.ndarray  # float32 [K]: multiply W's rows by it, divide the activation's channels by it
    alpha: float  # the exponent chosen: scales = mean|x|^alpha, normalised
    loss_before: float  # mean squared output error of round-to-nearest (alpha = 0) on the sample
    loss_after: float  # the same with the chosen scales
    losses: np.ndarray  # float64 [grid]: the loss of each alpha = i / grid


@dataclass(frozen=True, eq=False)
class AwqClip:
    """The range shrink factor AWQ chose per block, and the sample's output error with and without it."""

    shrink: np.ndarray  # float32 [n_blocks, N], in (max_shrink, 1]; pass to rtn_grid(shrink=...)
    loss_before: float  # mean squared output error with the full ranges
    loss_after: float  # the same with the chosen ranges


@dataclass(frozen=True, eq=False)
class AwqResult:
    """A weight quantized with AWQ: the packed codes of ``W * s`` and what the activation must be divided by."""

    weight: NBitsWeight  # codes and grid of W * scales[:, None]
    scales: AwqScales
    clip: AwqClip | None

    @property
    def activation_multiplier(self) -> np.ndarray:
        """``1 / s`` as float32 [K]: what the activation's channels are multiplied by before the MatMul."""
        return (1.0 / self.scales.scales.astype(np.float64)).astype(np.float32)


def _checked(weight: np.ndarray, x_sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(weight, np.float32)
    x = np.asarray(x_sample, np.float32)
    if w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[0] or x.shape[0] == 0:
        raise QtoolError(
            f"AWQ needs a weight [K, N] and input samples [T, K], got {w.shape} and {x.shape}",
            hint="the calibration inputs were collected for another node",
        )
    if not (np.all(np.isfinite(w)) and np.all(np.isfinite(x))):
        raise QtoolError("AWQ: the weight or the input samples hold inf or NaN", hint="keep this node in float")
    return w, x


def _output_loss(x: np.ndarray, weight_error: np.ndarray) -> float:
    """Mean squared ``x @ weight_error`` over tokens and outputs: the layer's output error."""
    return float(np.mean(np.square(x @ weight_error, dtype=np.float64)))


def channel_scales(input_mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """``mean|x|^alpha`` normalised so that its largest and smallest entries multiply to 1: float32 [K]."""
    mean = np.asarray(input_mean_abs, np.float64)
    top = mean.max(initial=0.0)
    if top <= 0:
        return np.ones(mean.shape, np.float32)
    powered = np.maximum(mean, MEAN_FLOOR * top) ** alpha
    return (powered / np.sqrt(powered.max() * powered.min())).astype(np.float32)


def awq_scales(
    weight: np.ndarray,
    input_mean_abs: np.ndarray,
    x_sample: np.ndarray,
    scheme: NBitsScheme,
    *,
    grid: int = DEFAULT_GRID,
) -> AwqScales:
    """Search the per-input-channel scales that minimise the quantized layer's output error on a sample.

    Args:
        weight: the float MatMul weight, [K, N].
        input_mean_abs: mean |x| of each input channel over all calibration tokens, [K].
        x_sample: a bounded sample of calibration inputs, [T, K] (the loss costs T x K x N per alpha).
        scheme: how the scaled weight will be quantized (bits, block size, symmetric).
        grid: alphas tried: 0, 1/grid, ..., (grid - 1)/grid.

    Returns:
        The chosen scales, their alpha and the sample's loss before and after.
    """
    w, x = _checked(weight, x_sample)
    mean = np.asarray(input_mean_abs, np.float64)
    if mean.shape != (w.shape[0],) or not np.all(np.isfinite(mean)) or np.any(mean < 0):
        raise QtoolError(
            f"AWQ needs a finite, non-negative mean |x| per input channel ({w.shape[0]}), got shape {mean.shape}",
            hint="the activation statistics were collected for another node",
        )
    if grid < 1:
        raise QtoolError(f"AWQ grid must be at least 1, got {grid}")
    losses = np.empty(grid)
    for i in range(grid):
        s = channel_scales(mean, i / grid)
        scaled = w * s[:, None]
        # (x / s) Q(W s) - x W = (x / s) (Q(W s) - W s): the error without the float cancellation.
        losses[i] = _output_loss(x / s, fake_quantize(scaled, scheme) - scaled)
    best = int(np.argmin(losses))  # the first of equal losses: the smallest alpha
    return AwqScales(channel_scales(mean, best / grid), best / grid, float(losses[0]), float(losses[best]), losses)


def awq_clip(
    weight: np.ndarray,
    x_sample: np.ndarray,
    scheme: NBitsScheme,
    *,
    grid: int = DEFAULT_GRID,
    max_shrink: float = DEFAULT_MAX_SHRINK,
) -> AwqClip:
    """Per block and output column, the range shrink factor with the lowest output error on a sample.

    Factors ``1 - i / grid`` above ``max_shrink`` are tried. Each block's error is measured
    alone (its share of the output, ``x[:, block] @ error[block, n]``), as AWQ does; the total
    loss also has cross terms between blocks, which is why both totals are reported.

    Args:
        weight: the weight as it will be quantized, [K, N] (already multiplied by AWQ's scales).
        x_sample: the inputs it will see, [T, K] (already divided by those scales).
        scheme: bits, block size, symmetric.
        grid: the factor step is 1 / grid.
        max_shrink: the smallest factor is the last one above this.

    Returns:
        The factors, [n_blocks, N], and the sample's loss before and after.
    """
    w, x = _checked(weight, x_sample)
    if not 0 <= max_shrink < 1 or grid < 1:
        raise QtoolError(f"AWQ clipping needs 0 <= max_shrink < 1 and grid >= 1, got {max_shrink} and {grid}")
    k, n = w.shape
    size = scheme.block_size
    blocks = block_count(k, size)
    factors = [1 - i / grid for i in range(grid) if 1 - i / grid > max_shrink]
    x_blocks = np.zeros((x.shape[0], blocks * size), np.float32)
    x_blocks[:, :k] = x
    best_error = np.full((blocks, n), np.inf)
    shrink = np.ones((blocks, n), np.float32)
    for factor in factors:
        error = np.zeros((blocks * size, n), np.float32)
        error[:k] = fake_quantize(w, scheme, shrink=factor) - w
        for b in range(blocks):
            rows = slice(b * size, (b + 1) * size)
            block_error = np.mean(np.square(x_blocks[:, rows] @ error[rows], dtype=np.float64), axis=0)
            better = block_error < best_error[b]
            best_error[b] = np.where(better, block_error, best_error[b])
            shrink[b] = np.where(better, factor, shrink[b])
    before = _output_loss(x, fake_quantize(w, scheme) - w)
    after = _output_loss(x, fake_quantize(w, scheme, shrink=shrink) - w)
    return AwqClip(shrink, before, after)


def awq_quantize(
    weight: np.ndarray,
    input_mean_abs: np.ndarray,
    x_sample: np.ndarray,
    scheme: NBitsScheme,
    *,
    grid: int = DEFAULT_GRID,
    clip: bool = True,
    max_shrink: float = DEFAULT_MAX_SHRINK,
    accuracy_level: int = 0,
) -> AwqResult:
    """AWQ's scales, then (with ``clip``) its clipping, then nearest rounding of ``W * s``, packed for MatMulNBits.

    The packed weight multiplies ``x / s``: the caller divides the activation by
    ``result.scales.scales`` (multiplies by :attr:`AwqResult.activation_multiplier`).
    Arguments are those of :func:`awq_scales` and :func:`awq_clip`.
    """
    found = awq_scales(weight, input_mean_abs, x_sample, scheme, grid=grid)
    s = found.scales
    scaled = np.asarray(weight, np.float32) * s[:, None]
    clipped = None
    shrink: np.ndarray | float = 1.0
    if clip:
        clipped = awq_clip(scaled, np.asarray(x_sample, np.float32) / s, scheme, grid=grid, max_shrink=max_shrink)
        shrink = clipped.shrink
    layout = rtn_grid(scaled, scheme, shrink=shrink)
    codes = round_codes(scaled, layout)
    zero = None if scheme.symmetric else layout.zero_points
    packed = pack_codes(codes, layout.scales, zero, scheme.bits, scheme.block_size, accuracy_level=accuracy_level)
    return AwqResult(packed, found, clipped)


def awq_weight(result: AwqResult) -> np.ndarray:
    """The float [K, N] weight the quantized layer applies to the original activation: ``Q(W s) / s``."""
    return dequantize(result.weight) / result.scales.scales[:, None]
