"""Apply the weight algorithms during the rewrite: codes from GPTQ, bias shifts from bias correction.

One :class:`WeightAlgorithms` serves a whole ``quantize`` run. The placement choice rewrites
the model several times with the same weights on the same grids, so codes are kept per
(weight, grid, readers) and computed once.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace

import numpy as np

from qtool.numerics.qparams import QParams, dequantize
from qtool.numerics.saturation import PAIR_LIMIT, codes_within_limit, kernel_rows
from qtool.quantization.algorithms.rounding.adaround import AdaRoundSchedule, adaround
from qtool.quantization.algorithms.rounding.bias_correction import bias_correction
from qtool.quantization.algorithms.rounding.gptq import (
    HessianFactors,
    RowGrid,
    gptq_round,
    hessian_factors,
    output_error,
    pair_partners,
    qparams_rows,
    rows_to_weight,
    weight_rows,
)
from qtool.quantization.algorithms.rounding.node_inputs import NodeInput, NodeInputs
from qtool.quantization.plan.records import NodePlan

log = logging.getLogger(__name__)

ADAROUND = AdaRoundSchedule(iterations=200)  # steps per weight
ADAROUND_WORK = 4e10  # multiply-adds per weight (about 5 s on 2 cores): the schedule is shortened to fit,
# deterministically (a wall-clock limit would make the output depend on the machine's load)
FACTORS_KEPT_BYTES = 128 << 20  # GPTQ's Hessian factors kept for other grids of the same weights
ADAROUND_MAX_K = 1024  # longer reductions keep GPTQ's codes (a K=4608 layer needs minutes)


@dataclass(frozen=True)
class Rounded:
    """A weight copy's integers and the rounding that chose them (``nearest`` when none other could)."""

    codes: np.ndarray | None  # None: nearest rounding (the caller quantizes)
    method: str
    reason: str = ""  # why a requested method was not used


@dataclass
class WeightAlgorithms:
    """The calibration inputs of one run and the codes computed from them."""

    inputs: NodeInputs
    cache: dict[str, np.ndarray] = field(default_factory=dict)  # codes by weight, grid and readers
    factors: dict[tuple[str, ...], HessianFactors] = field(default_factory=dict)  # by readers: the same on any grid
    # measured bias shifts by plan, and why some nodes could not be measured
    shifts: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]] = field(default_factory=dict)

    def round(
        self, weight: str, values: np.ndarray, qp: QParams, readers: list[NodePlan], pair_layout: str | None = None
    ) -> Rounded:
        """The codes of ``weight`` on ``qp``'s grid for ``readers`` (the nodes that read this copy).

        ``pair_layout``: the integer kernel's weight pairs (a :mod:`qtool.numerics.saturation`
        layout), when they must stay within the pair limit: GPTQ then keeps them there itself, compensating
        what it clips.
        """
        asked = sorted({r.scheme.algorithms.rounding for r in readers} - {"nearest"})
        if not asked:
            return Rounded(None, "nearest")
        if qp.qtype.float8:  # GPTQ and AdaRound choose between neighbouring integers of a uniform grid
            return Rounded(None, "nearest", f"{qp.qtype.name} weights are rounded to the nearest fp8 value")
        missing = [r.name for r in readers if r.name not in self.inputs.stats]
        if missing:
            why = self.inputs.skipped.get(missing[0], "its inputs were not observed")
            # one reader (the usual case): the note is per node already, and the same words group in the summary
            return Rounded(None, "nearest", why if len(readers) == 1 else f"node {missing[0]}: {why}")
        layouts = {self._shape_of(self.inputs.layouts[r.name]) for r in readers}
        if len(layouts) > 1:
            return Rounded(None, "nearest", "its readers use the weight in different layouts")
        layout = self.inputs.layouts[readers[0].name]
        rows = weight_rows(values, layout.kind, trans_b=layout.trans_b)
        # AdaRound refines GPTQ's codes; on long reductions it would take minutes, so GPTQ's stay
        method = "adaround" if "adaround" in asked and rows.shape[1] <= ADAROUND_MAX_K else "gptq"
        scale, zero = qparams_rows(qp, values, layout.kind, trans_b=layout.trans_b)
        kernel = kernel_rows(np.arange(values.size).reshape(values.shape), pair_layout) if pair_layout else None
        partners = None if kernel is None else pair_partners(values.shape, layout.kind, kernel, trans_b=layout.trans_b)
        paired = f"{method}/pairs:{pair_layout}" if partners is not None else method
        key = _key(weight, paired, values, scale, zero, qp, [r.name for r in readers])
        if key not in self.cache:
            names = tuple(sorted(r.name for r in readers))
            hessians = [self.inputs.stats[n].hessian() for n in names]
            hessian = hessians[0] if len(hessians) == 1 else np.mean(hessians, axis=0)
            factors = self._factors(names, hessian)
            grid = RowGrid(scale, zero, qp.qmin, qp.qtype.qmax)
            result = gptq_round(rows, hessian, grid, factors=factors)
            chosen = result.codes
            if partners is not None and pair_layout is not None:
                problem = (rows, hessian, grid, factors)
                chosen = _paired(values, qp, problem, chosen, (partners, pair_layout, layout))
            if method == "adaround":
                problem = (rows, hessian, grid, factors)
                limit = (partners, pair_layout, layout) if partners is not None and pair_layout is not None else None
                chosen = _learned(values, qp, problem, chosen, limit)
            codes = rows_to_weight(chosen, values.shape, layout.kind, trans_b=layout.trans_b)
            self.cache[key] = codes.astype(qp.qtype.numpy_dtype)
            if result.nearest_groups:
                log.info("%s: %d weight groups kept nearest rounding", weight, result.nearest_groups)
        return Rounded(self.cache[key], method)

    def _factors(self, names: tuple[str, ...], hessian: np.ndarray) -> HessianFactors:
        """The factors of the readers' Hessian: kept for another grid while they fit :data:`FACTORS_KEPT_BYTES`.

        A model's factors together weigh as much as its Hessians (a YOLOv8n's: hundreds of MB); the oldest are let
        go first, and factored again if a grid needs them later.
        """
        if names in self.factors:
            return self.factors[names]
        factors = hessian_factors(hessian)
        while self.factors and sum(f.upper.nbytes for f in self.factors.values()) + factors.upper.nbytes > (
            FACTORS_KEPT_BYTES
        ):
            self.factors.pop(next(iter(self.factors)))
        self.factors[names] = factors
        return factors

    def bias_shift(self, node: NodePlan, values: np.ndarray, codes: np.ndarray, qp: QParams) -> np.ndarray | None:
        """What to add to ``node``'s bias to cancel the mean output shift of its rounded weight (None: no data)."""
        if not node.scheme.algorithms.bias_correction or node.name not in self.inputs.stats:
            return None
        layout = self.inputs.layouts[node.name]
        rows = weight_rows(values, layout.kind, trans_b=layout.trans_b)
        rounded = weight_rows(dequantize(codes, qp), layout.kind, trans_b=layout.trans_b)
        return bias_correction(rows, rounded, self.inputs.stats[node.name].mean())

    @staticmethod
    def _shape_of(layout: NodeInput) -> tuple[str, bool, object]:
        group = getattr(layout.geometry, "group", 1)
        return layout.kind, layout.trans_b, group


def _paired(
    values: np.ndarray,
    qp: QParams,
    problem: tuple[np.ndarray, np.ndarray, RowGrid, HessianFactors],
    free: np.ndarray,
    pairs: tuple[np.ndarray, str, NodeInput],
) -> np.ndarray:
    """Codes within the pair limit: GPTQ keeping the pairs itself, or its free codes nudged, whichever errs less.

    Inside the loop a pair's second code takes the whole excess but the error is compensated; nudged
    afterwards, the excess is split between both codes but nothing compensates it: either can win.
    """
    rows, hessian, grid, factors = problem
    partners, pair_layout, layout = pairs
    limited = replace(grid, partners=partners, pair_limit=PAIR_LIMIT)
    inside = gptq_round(rows, hessian, limited, factors=factors).codes
    after = _nudged(values, qp, free, pair_layout, layout)
    return min((inside, after), key=lambda codes: output_error(rows, codes, grid, hessian))


def _learned(
    values: np.ndarray,
    qp: QParams,
    problem: tuple[np.ndarray, np.ndarray, RowGrid, HessianFactors],
    start: np.ndarray,
    pairs: tuple[np.ndarray, str, NodeInput] | None,
) -> np.ndarray:
    """AdaRound's codes, learned row by row from ``start`` (GPTQ's, within the pair limit where it holds).

    AdaRound never returns a row worse than its start by its own loss, which knows no pair limit: where one
    holds (``pairs``), its codes are brought within it and kept only when they still err less than ``start``.
    """
    rows, hessian, grid, _ = problem
    learned = adaround(rows, hessian, grid, init=start, work=ADAROUND_WORK, schedule=ADAROUND).codes
    if pairs is None:
        return learned
    _, pair_layout, layout = pairs
    within = _nudged(values, qp, learned, pair_layout, layout)
    return min((start, within), key=lambda codes: output_error(rows, codes, grid, hessian))


def _nudged(values: np.ndarray, qp: QParams, codes: np.ndarray, pair_layout: str, layout: NodeInput) -> np.ndarray:
    """``codes`` (weight rows) with every pair past the limit brought within it, as weight rows again."""
    as_weight = rows_to_weight(codes, values.shape, layout.kind, trans_b=layout.trans_b).astype(np.int64)
    nudged, _ = codes_within_limit(values, qp, pair_layout, lambda _: as_weight)
    return weight_rows(nudged, layout.kind, trans_b=layout.trans_b)


def _key(
    weight: str, method: str, values: np.ndarray, scale: np.ndarray, zero: np.ndarray, qp: QParams, readers: list[str]
) -> str:
    digest = hashlib.sha256()
    for part in (weight, method, qp.qtype.name, str(qp.qmin), *sorted(readers)):
        digest.update(part.encode() + b"\0")
    for array in (values, scale, zero):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
