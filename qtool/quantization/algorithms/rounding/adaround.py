"""AdaRound: learn, per weight, whether to round down or up, so that the layer's output error is smallest.

Nearest rounding minimises ``||Q - W||^2`` element by element; what matters is the output
error ``||(Q - W) X||^2 = N * sum_rows (Q - W) H (Q - W)^T`` with ``H = E[x x^T]``, whose
off-diagonal terms let errors cancel (Nagel et al., 2020, "Up or Down? Adaptive Rounding for
Post-Training Quantization"). Each weight may go to ``floor(W / s)`` or one step above; a
continuous ``V`` chooses through the rectified sigmoid ``h(V)``, Adam minimises the
reconstruction loss plus a regulariser that, as its exponent ``beta`` is annealed from 20 to 2,
drives every ``h`` to exactly 0 or 1, and the result is rounded hard at the end.

Only the input Hessian is used: the loss is exact for a linear layer, so no samples are
replayed and every step is a full-batch step. Rows are independent given ``H``, which makes
two guarantees cheap: each row keeps the better of its starting codes and the learned ones, so
the result is never worse than nearest rounding (nor than ``init`` codes such as GPTQ's), and a
compute budget can shorten the schedule and still return valid codes. The budget counts
multiply-adds, not seconds, so the same inputs give the same codes on any machine and load.
Like GPTQ, the scale and zero point are fixed inputs: AdaRound only picks different integers on the caller's grid.

The defaults differ from the paper's (10-20k mini-batch steps at ``lr=1e-3`` and ``lambda=0.01``)
because the budget here is a few hundred exact steps: on synthetic correlated layers a large
step (``lr=0.5`` on ``V``) with a strong regulariser (``reg_weight=1`` against a reconstruction
loss in grid units) reaches in 200 steps what the paper's settings reach in thousands, and
``lr=2`` already overshoots into the saturated ends of ``h`` where the gradient vanishes.

Cost: one [rows, K] x [K, K] float32 product per step, ``2 * iterations * rows * K^2`` flops in all
(GPTQ's whole run costs about one step), and the memory a few float32 copies of at most
:data:`TILE_ELEMENTS` weights besides the inputs. Measured on 2 CPU cores (about 18 GFLOP/s) at 200
steps: K=576 (a 3x3 Conv over 64 channels) with 128 rows takes 5-7 s, K=4608 with 512 rows about 5
minutes (GPTQ: 0.3 s and 50 s). Callers should keep AdaRound to layers with K up to about 1024 (a
``max_k`` setting) and give the rest to GPTQ, or pass ``work``: the schedule is then shortened to
fit, and a few dozen steps still help.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from qtool.errors import QtoolError
from qtool.quantization.algorithms.rounding.gptq import RowGrid, round_nearest

log = logging.getLogger(__name__)

ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch: h reaches exactly 0 and 1 at finite V
TILE_ELEMENTS = 1 << 20  # weights optimised together: bounds the float32 working set to a few tens of MB
CHECK_EVERY = 10  # steps between convergence checks
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.999, 1e-8

StopReason = Literal["iterations", "converged", "budget"]


@dataclass(frozen=True, eq=False)
class AdaRoundResult:
    """The integer codes AdaRound chose, and how it got there."""

    codes: np.ndarray  # int64 [rows, K], on the caller's grid
    iterations: int  # Adam steps run (the most any tile of rows ran)
    seconds: float  # wall-clock time spent
    nearest_loss: float  # sum_rows (Q - W) H (Q - W)^T with nearest rounding, i.e. ||(Q - W) X||^2 / N
    initial_loss: float  # the same for the starting codes (per row the better of nearest and ``init``)
    final_loss: float  # the same for ``codes``; never above ``initial_loss``
    stopped: StopReason  # "iterations": all ran; "converged": every h was 0 or 1; "budget": the budget cut it short
    improved_rows: int  # rows whose learned codes beat their starting codes; the others kept the starting ones

    @property
    def method(self) -> str:
        """``"adaround"`` when any row's learned codes were kept, else ``"initial"`` (the starting codes)."""
        return "adaround" if self.improved_rows else "initial"


@dataclass(frozen=True)
class AdaRoundSchedule:
    """Adam's steps and step size, and the regulariser's weight and exponent over the steps."""

    iterations: int = 200  # Adam steps per tile of rows; the warm-up and annealing span them
    lr: float = 0.5  # Adam's learning rate on ``V``
    # the rounding regulariser's weight ``lambda`` per weight, against a reconstruction loss in units of
    # each row's squared grid step times its mean input power (nearest rounding on white inputs: ~1/12)
    reg_weight: float = 1.0
    beta: tuple[float, float] = (20.0, 2.0)  # the regulariser's exponent at the end of the warm-up, at the last step
    warmup: float = 0.2  # the fraction of the steps without the regulariser

    def beta_at(self, step: int, planned: int) -> float | None:
        """The exponent at ``step`` (0-based) of ``planned`` steps, or ``None`` during the warm-up."""
        warm = int(self.warmup * planned)
        if step < warm:
            return None
        progress = (step - warm) / max(planned - warm, 1)
        return self.beta[0] + (self.beta[1] - self.beta[0]) * min(progress, 1.0)


DEFAULT_SCHEDULE = AdaRoundSchedule()


def adaround(
    weight_rows: np.ndarray,
    hessian: np.ndarray,
    grid: RowGrid,
    *,
    init: Literal["nearest"] | np.ndarray = "nearest",
    work: float | None = None,
    schedule: AdaRoundSchedule = DEFAULT_SCHEDULE,
) -> AdaRoundResult:
    """Integer codes for ``weight_rows`` that minimise the output error on inputs with ``hessian``.

    Its cost is in the module's docstring (keep it to K up to about 1024, or pass ``work``).

    Args:
        weight_rows: the float weight as [rows, K] (see :func:`~.gptq.weight_rows`).
        hessian: ``E[x x^T]`` as [K, K], or [groups, K, K] for grouped Conv (rows split evenly).
        grid: the scale, zero point and code range to round onto.
        init: where to start: ``"nearest"`` (each ``h`` at its weight's fractional position on
            the grid, as in the paper) or int codes [rows, K] on this grid, e.g.
            ``GptqResult.codes``, to refine; each weight then chooses between its code and the
            neighbour towards the float weight.
        work: a budget of multiply-adds for the whole call (``None``: none), counted as
            ``rows * K^2`` per step. When the planned steps do not fit, the schedule (warm-up
            and annealing) is shortened to what does, so every ``h`` is still decided, and
            ``stopped == "budget"``. Unlike a wall-clock limit, the result does not depend on
            the machine or its load.
        schedule: Adam's steps, learning rate and the regulariser (see :class:`AdaRoundSchedule`).

    Returns:
        The codes, on the same grid as nearest rounding with this scale and zero point, with
        no row's loss above its starting codes'.
    """
    started = time.perf_counter()
    rows, k = np.shape(weight_rows)
    layer = _layer(weight_rows, hessian, grid)
    nearest_loss, start, start_loss = _start(layer, init)
    iterations = schedule.iterations
    planned = iterations if work is None else min(iterations, math.floor(max(work, 0.0) / max(rows * k * k, 1)))
    codes, loss, ran, reasons = _learn(
        layer, start, start_loss, not isinstance(init, str), replace(schedule, iterations=planned)
    )
    stopped: StopReason = (
        "budget" if planned < iterations else "converged" if reasons == {"converged"} else "iterations"
    )
    improved = int((loss < start_loss).sum())
    elapsed = time.perf_counter() - started
    log.debug("AdaRound: %d of %d rows improved in %.2f s, %d steps (%s)", improved, rows, elapsed, ran, stopped)
    return AdaRoundResult(
        codes=codes.reshape(rows, k),
        iterations=ran,
        seconds=elapsed,
        nearest_loss=float(nearest_loss.sum()),
        initial_loss=float(start_loss.sum()),
        final_loss=float(loss.sum()),
        stopped=stopped,
        improved_rows=improved,
    )


def _layer(weight_rows: np.ndarray, hessian: np.ndarray, grid: RowGrid) -> _RoundedLayer:
    """The weight, Hessian and grid as groups of rows, or a clear error when they do not fit together."""
    w = np.asarray(weight_rows, np.float32)
    rows, k = w.shape
    h = np.asarray(hessian, np.float64)
    h = h[None] if h.ndim == 2 else h
    groups = h.shape[0]
    if h.ndim != 3 or h.shape[1:] != (k, k) or rows % groups:
        raise QtoolError(
            f"a Hessian of shape {np.shape(hessian)} does not fit a weight of {rows} rows x {k} columns",
            hint="the input statistics were collected for another node",
        )
    shape = (groups, rows // groups, k)
    scale_full, zero_full = grid.per_element(rows, k)
    return _RoundedLayer(w.reshape(shape), h, scale_full.reshape(shape), zero_full.reshape(shape), grid.qmin, grid.qmax)


def _start(layer: _RoundedLayer, init: Literal["nearest"] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nearest rounding's loss per row, and the codes (and their loss) each row starts from.

    A row whose given codes are worse than nearest rounding starts from nearest rounding.
    """
    if isinstance(init, str) and init != "nearest":
        raise QtoolError(f"unknown AdaRound init '{init}'", hint="pass 'nearest' or int codes [rows, K]")
    groups, per_group, k = layer.w.shape
    nearest = round_nearest(layer.w, layer.scale, layer.zero, layer.qmin, layer.qmax)
    nearest_loss = layer.loss(nearest)
    if isinstance(init, str):
        return nearest_loss, nearest, nearest_loss
    given = _checked_init(init, groups * per_group, k, layer.qmin, layer.qmax).reshape(layer.w.shape)
    given_loss = layer.loss(given)
    better = given_loss <= nearest_loss
    return nearest_loss, np.where(better[..., None], given, nearest), np.where(better, given_loss, nearest_loss)


def _learn(
    layer: _RoundedLayer, start: np.ndarray, start_loss: np.ndarray, from_codes: bool, schedule: AdaRoundSchedule
) -> tuple[np.ndarray, np.ndarray, int, set[StopReason]]:
    """Learn each tile of rows from its starting codes; a tile's learned codes replace them only where better."""
    codes, loss = start.copy(), start_loss.copy()
    reasons: set[StopReason] = set()
    ran = 0
    for g, r in _tiles(*layer.w.shape) if schedule.iterations else ():
        tile = layer.tile(g, r)
        learned, tile_ran, tile_stopped = tile.learn(start[g, r], from_codes, schedule)
        learned_loss = tile.loss(learned)
        better = learned_loss < loss[g, r]
        codes[g, r] = np.where(better[..., None], learned, codes[g, r])
        loss[g, r] = np.where(better, learned_loss, loss[g, r])
        ran = max(ran, tile_ran)
        reasons.add(tile_stopped)
    return codes, loss, ran, reasons


@dataclass(frozen=True)
class _RoundedLayer:
    """A weight, its Hessian and grid as [groups, rows, K], [groups, K, K] and [groups, rows, K]."""

    w: np.ndarray  # float32
    h: np.ndarray  # float64
    scale: np.ndarray  # float32
    zero: np.ndarray  # int64
    qmin: int
    qmax: int

    def tile(self, g: slice, r: slice) -> _RoundedLayer:
        return _RoundedLayer(self.w[g, r], self.h[g], self.scale[g, r], self.zero[g, r], self.qmin, self.qmax)

    def loss(self, codes: np.ndarray) -> np.ndarray:
        """``(Q - W) H (Q - W)^T`` per row of codes [groups, rows, K], in float64 -> [groups, rows]."""
        error = ((codes - self.zero).astype(np.float32) * self.scale).astype(np.float64) - self.w
        return np.sum((error @ self.h) * error, axis=-1)

    def learn(
        self, start: np.ndarray, from_codes: bool, schedule: AdaRoundSchedule
    ) -> tuple[np.ndarray, int, StopReason]:
        """Adam on ``V``; the hard-rounded codes, the steps run and why they stopped."""
        w, s, h = self.w, self.scale, self.h.astype(np.float32)
        lo = (self.qmin - self.zero).astype(np.float32)
        hi = (self.qmax - self.zero).astype(np.float32)
        steps = w / s
        if from_codes:
            # Choose between the given code and its neighbour towards the weight, starting at the code.
            code = (start - self.zero).astype(np.float32)
            down = steps < code
            base = code - down
            target = down.astype(np.float32)
        else:
            base = np.floor(steps)
            target = steps - base
        # Start just inside (0, 1): at exactly 0 or 1 the clip would hide the gradient.
        v = _inverse_h(np.clip(target, 0.01, 0.99))
        # The reconstruction per row in units of the squared grid step times the mean input power,
        # so that ``reg_weight`` means the same for any layer.
        power = np.diagonal(self.h, axis1=1, axis2=2)[:, None, :]
        norm = np.mean(s.astype(np.float64) ** 2 * power, axis=-1, keepdims=True)
        rec_weight = (2.0 / np.where(norm > 0, norm, 1.0)).astype(np.float32)
        moment1 = np.zeros_like(v)
        moment2 = np.zeros_like(v)
        planned = schedule.iterations
        stopped: StopReason = "iterations"
        ran = 0
        while ran < planned:
            sig = 1.0 / (1.0 + np.exp(-v))
            pre = sig * (ZETA - GAMMA) + GAMMA
            soft = np.clip(pre, 0.0, 1.0)
            level = base + soft
            error = s * np.clip(level, lo, hi) - w
            grad_h = (error @ h) * rec_weight * s * ((level >= lo) & (level <= hi))
            b = schedule.beta_at(ran, planned)
            if b is not None:
                centred = 2.0 * soft - 1.0
                grad_h -= schedule.reg_weight * 2.0 * b * np.sign(centred) * np.abs(centred) ** (b - 1.0)
            grad_v = grad_h * ((ZETA - GAMMA) * sig * (1.0 - sig)) * ((pre >= 0.0) & (pre <= 1.0))
            moment1 = ADAM_BETA1 * moment1 + (1.0 - ADAM_BETA1) * grad_v
            moment2 = ADAM_BETA2 * moment2 + (1.0 - ADAM_BETA2) * grad_v * grad_v
            m_hat = moment1 / (1.0 - ADAM_BETA1 ** (ran + 1))
            v_hat = moment2 / (1.0 - ADAM_BETA2 ** (ran + 1))
            v -= (schedule.lr * m_hat / (np.sqrt(v_hat) + ADAM_EPS)).astype(np.float32)
            ran += 1
            if ran % CHECK_EVERY:
                continue
            # Past the warm-up, once every h is exactly 0 or 1 the clip stops all gradients: nothing can change.
            if b is not None and ran < planned and not np.any((pre > 0.0) & (pre < 1.0)):
                stopped = "converged"
                break
        up = _h(v) >= 0.5
        return np.clip(base + up, lo, hi).astype(np.int64) + self.zero, ran, stopped


def _h(v: np.ndarray) -> np.ndarray:
    """The rectified sigmoid ``clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``."""
    return np.clip((1.0 / (1.0 + np.exp(-v))) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def _inverse_h(target: np.ndarray) -> np.ndarray:
    """``V`` with ``h(V) == target`` for targets strictly inside (0, 1), as float32."""
    p = (target - GAMMA) / (ZETA - GAMMA)
    return np.log(p / (1.0 - p)).astype(np.float32)


def _tiles(groups: int, rows: int, k: int) -> list[tuple[slice, slice]]:
    """(group, row) slices covering [groups, rows, K] in pieces of about :data:`TILE_ELEMENTS` weights."""
    per_group = rows * k
    if per_group <= TILE_ELEMENTS:
        step = max(1, TILE_ELEMENTS // max(per_group, 1))
        return [(slice(g, min(g + step, groups)), slice(0, rows)) for g in range(0, groups, step)]
    step = max(1, TILE_ELEMENTS // k)
    return [(slice(g, g + 1), slice(r, min(r + step, rows))) for g in range(groups) for r in range(0, rows, step)]


def _checked_init(init: np.ndarray, rows: int, k: int, qmin: int, qmax: int) -> np.ndarray:
    """``init`` codes as int64 [rows, K], refused when they do not belong to this weight's grid."""
    codes = np.asarray(init)
    if codes.shape != (rows, k) or not np.issubdtype(codes.dtype, np.integer):
        raise QtoolError(
            f"AdaRound init codes of shape {codes.shape} and dtype {codes.dtype} are not int [{rows}, {k}]",
            hint="pass the codes of this weight's rows, e.g. GptqResult.codes",
        )
    if codes.size and (codes.min() < qmin or codes.max() > qmax):
        raise QtoolError(
            f"AdaRound init codes span [{codes.min()}, {codes.max()}], outside the grid's [{qmin}, {qmax}]",
            hint="pass codes computed with the same qmin and qmax",
        )
    return codes.astype(np.int64)
