"""AdaRound (Nagel et al., 2020): learn, per weight, whether to round up or down, layer by layer.

On a fixed grid (scale and zero point unchanged) each weight ``w = s (b + f)`` (``b`` its floor
step, ``f`` the fraction) becomes ``s (b + h(V))`` with the rectified sigmoid
``h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1)``. ``V`` minimises the layer's output error
on its calibration inputs, ``sum_rows dW H dW^T`` with the input Hessian ``H = E[x x^T]`` (no
samples needed beyond the Hessian), plus a regulariser ``lambda sum(1 - |2h - 1|^beta)`` that
pushes every ``h`` to 0 or 1 as ``beta`` anneals from 20 to 2. Adam, in numpy, with a bound on
iterations and on seconds; the result is hard-rounded and never worse, on that error, than the
codes it started from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from qtool.quantization.algorithms.gptq import _per_column, round_nearest

ZETA, GAMMA = 1.1, -0.1
WARMUP = 0.2  # share of the iterations without the regulariser
REGULARISER = 0.01  # lambda, relative to the initial reconstruction error
BETA = (20.0, 2.0)
LEARNING_RATE = 0.01


@dataclass(frozen=True, eq=False)
class AdaRoundResult:
    """The codes AdaRound chose, and how it got there."""

    codes: np.ndarray  # int64 [rows, K], on the caller's grid
    iterations: int
    seconds: float
    start_loss: float  # output error of the starting codes
    loss: float  # output error of the returned codes
    stopped: str  # "iterations" | "time"
    improved: bool  # False: the starting codes were kept


def reconstruction_error(
    weight: np.ndarray, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, h: np.ndarray
) -> float:
    """``sum_rows dW H dW^T`` of [groups, rows, K] codes against the weight, per element scale and zero."""
    delta = (codes - zero) * scale - weight
    return float(np.einsum("grk,gkl,grl->", delta, h, delta))


def adaround(
    weight_rows: np.ndarray,
    hessian: np.ndarray,
    scale: np.ndarray | float,
    zero_point: np.ndarray | int,
    qmin: int,
    qmax: int,
    *,
    start: np.ndarray | None = None,
    iterations: int = 200,
    seconds: float = 5.0,
    block_size: int | None = None,
) -> AdaRoundResult:
    """Integer codes for ``weight_rows`` ([rows, K]) learned against the input Hessian ([K, K] or [groups, K, K]).

    ``scale``/``zero_point`` are laid out as for :func:`qtool.quantization.algorithms.gptq.gptq_round`;
    ``start`` are codes to begin from (GPTQ's, say; nearest rounding by default).
    """
    began = time.perf_counter()
    w = np.asarray(weight_rows, np.float64)
    rows, k = w.shape
    h = np.asarray(hessian, np.float64)
    h = h[None] if h.ndim == 2 else h
    groups = h.shape[0]
    scale_full = _per_column(np.asarray(scale, np.float32), rows, k, block_size).astype(np.float64)
    zero_full = _per_column(np.asarray(zero_point, np.int64), rows, k, block_size)
    begin = round_nearest(w, scale_full, zero_full, qmin, qmax) if start is None else np.asarray(start, np.int64)
    shape = (groups, rows // groups, k)
    wg, sg, zg = w.reshape(shape), scale_full.reshape(shape), zero_full.reshape(shape)
    start_codes = begin.reshape(shape)
    start_loss = reconstruction_error(wg, start_codes, sg, zg, h)
    floor = np.floor(wg / sg) + zg  # the code below each weight
    low, high = np.clip(floor, qmin, qmax), np.clip(floor + 1, qmin, qmax)
    # h(V) starts at the fraction (the paper's start), or leaning towards given starting codes
    fraction = np.clip(wg / sg + zg - floor, 0.01, 0.99)
    target = fraction if start is None else np.where(start_codes >= floor + 1, 0.75, 0.25)
    v = -np.log((ZETA - GAMMA) / (target - GAMMA) - 1.0)
    m, u = np.zeros_like(v), np.zeros_like(v)
    norm = max(start_loss, 1e-30)
    done, stopped = 0, "iterations"
    for step in range(iterations):
        if time.perf_counter() - began > seconds:
            stopped = "time"
            break
        sig = 1.0 / (1.0 + np.exp(-v))
        soft = np.clip(sig * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
        codes = low + soft * (high - low)
        delta = (codes - zg) * sg - wg
        grad_w = 2.0 * np.einsum("grk,gkl->grl", delta, h) / norm
        inside = ((sig * (ZETA - GAMMA) + GAMMA) > 0) & ((sig * (ZETA - GAMMA) + GAMMA) < 1)
        dsoft = np.where(inside, sig * (1 - sig) * (ZETA - GAMMA), 0.0)
        grad = grad_w * sg * (high - low) * dsoft
        if step >= WARMUP * iterations:
            progress = (step - WARMUP * iterations) / max(1.0, (1 - WARMUP) * iterations)
            beta = BETA[0] + (BETA[1] - BETA[0]) * progress
            centred = 2 * soft - 1
            grad += REGULARISER * (-beta * np.abs(centred) ** (beta - 1) * np.sign(centred) * 2) * dsoft
        m = 0.9 * m + 0.1 * grad
        u = 0.999 * u + 0.001 * grad**2
        v -= LEARNING_RATE * (m / (1 - 0.9 ** (step + 1))) / (np.sqrt(u / (1 - 0.999 ** (step + 1))) + 1e-8)
        done = step + 1
    hard = np.where(v >= -np.log((ZETA - GAMMA) / (0.5 - GAMMA) - 1.0), high, low).astype(np.int64)
    loss = reconstruction_error(wg, hard, sg, zg, h)
    improved = loss < start_loss
    codes = (hard if improved else start_codes).reshape(rows, k)
    return AdaRoundResult(
        codes, done, time.perf_counter() - began, start_loss, min(loss, start_loss), stopped, improved
    )
