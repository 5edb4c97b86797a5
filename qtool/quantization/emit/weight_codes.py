"""The integers of each stored weight copy and their qparams, computed once per copy.

A copy's grid comes from the reader whose scheme it is (an integer kernel's, when one reads the
weight), widened where an int32 bias read with it would saturate; its integers are rounded to
nearest or by the readers' rounding algorithm (GPTQ, AdaRound), which the report credits.
"""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np
import onnx

from qtool.graph.weights import Weights
from qtool.numerics.qparams import QParams, quantize
from qtool.numerics.ranges import weight_qparams
from qtool.numerics.saturation import PairFit, codes_within_limit, fit_pairs
from qtool.quantization.algorithms.rounding.weight_rounding import WeightAlgorithms
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.emit.weight_copies import CopyKey, WeightUse, copy_key
from qtool.quantization.plan.records import NodePlan, QuantPlan

_INT32_MAX = float(np.iinfo(np.int32).max)
# fitted grids and their codes by weight content (nearest rounding), the codes up to a memory budget
_FITS: dict[tuple[object, ...], tuple[QParams, PairFit, np.ndarray | None]] = {}
_FITS_KEPT = 256
_CODES_KEPT_BYTES = 128 << 20


class WeightCodes:
    """Qparams and integers by (weight, copy), for one rewrite."""

    def __init__(
        self,
        plan: QuantPlan,
        uses: dict[str, WeightUse],
        store: Weights,
        inits: dict[str, onnx.TensorProto],
        act_qparams: dict[str, QParams],
        algorithms: WeightAlgorithms | None,
        report: RewriteReport,
    ) -> None:
        self.plan, self.uses, self.store, self.inits = plan, uses, store, inits
        self.act_qparams, self.algorithms, self.report = act_qparams, algorithms, report
        self.codes: dict[tuple[str, CopyKey], np.ndarray] = {}  # the integers of each copy
        self.qparams: dict[tuple[str, CopyKey], QParams] = {}  # and their qparams
        self._rounded: dict[tuple[str, CopyKey], tuple[str, str | None]] = {}  # the rounding each copy got
        self._readers: dict[tuple[str, CopyKey], list[NodePlan]] = {}  # the plan nodes reading each copy
        for p in plan.nodes:
            if p.name in uses:
                self._readers.setdefault((uses[p.name].weight, uses[p.name].copy), []).append(p)

    def of(self, use: WeightUse, values: np.ndarray) -> tuple[QParams, np.ndarray]:
        """The qparams and integers of ``use``'s copy, computed on first use (not stored in the graph)."""
        key = (use.weight, use.copy)
        if key in self.codes:
            return self.qparams[key], self.codes[key]
        owner = next(p for p in self.plan.nodes if p.weight and p.weight.name == use.weight and copy_key(p) == use.copy)
        assert owner.weight is not None  # found by its weight
        qp = weight_qparams(
            values,
            owner.scheme.weight,
            owner.weight.axis,
            f"weight {use.weight}",
            owner.weight.block_size,
            reduce_range=owner.reduced_weight_range,
        )
        floor = self._bias_scale_floor(use.weight, use.copy)
        if floor is not None and np.any(qp.scale < floor):
            raised = np.maximum(qp.scale, floor).astype(np.float32)
            qp = QParams(raised, qp.zero_point, qp.qtype, qp.axis, qp.block_size, qp.narrow)
        if owner.fits_weight_pairs and owner.pair_layout is not None:
            qp, codes, fit = self._fitted(use, values, qp, owner.pair_layout)
            for reader in self.readers(use):
                self.report.pair_fits[reader.name] = fit
        else:
            codes = self._round(use, values, qp)
        self._credit(use)
        self.codes[key], self.qparams[key] = codes, qp
        return qp, codes

    def _fitted(
        self, use: WeightUse, values: np.ndarray, qp: QParams, layout: str
    ) -> tuple[QParams, np.ndarray, PairFit]:
        """:func:`fit_pairs` of one copy; for nearest rounding its grid is chosen once per process.

        The placement choice rewrites the model once per candidate and search trial: choosing the same weight's
        grid and rounding it again each time would cost most of a rewrite. The grid is kept, and its codes while
        they fit a memory budget (past it they are rounded again: a large model's codes would hold memory).
        """
        rounded = self.algorithms is not None and any(
            r.scheme.algorithms.rounding != "nearest" for r in self.readers(use)
        )
        if rounded:  # at the fitted scales GPTQ keeps the pairs within the limit itself
            return fit_pairs(
                values,
                qp,
                layout,
                lambda grid: self._round(use, values, grid),
                lambda grid: self._round(use, values, grid, layout),
            )
        key = (
            hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=16).hexdigest(),
            values.shape,
            str(values.dtype),
            np.asarray(qp.scale).tobytes(),
            qp.axis,
            layout,
        )
        nearest = partial(quantize, values)
        if key in _FITS:
            fitted, fit, kept = _FITS[key]
            codes = kept.copy() if kept is not None else codes_within_limit(values, fitted, layout, nearest)[0]
            return fitted, codes, fit
        if len(_FITS) >= _FITS_KEPT:
            _FITS.pop(next(iter(_FITS)))
        fitted, codes, fit = fit_pairs(values, qp, layout, nearest)
        held = sum(c.nbytes for _, _, c in _FITS.values() if c is not None)
        _FITS[key] = (fitted, fit, codes.copy() if held + codes.nbytes <= _CODES_KEPT_BYTES else None)
        return fitted, codes, fit

    def readers(self, use: WeightUse) -> list[NodePlan]:
        """The plan nodes that read ``use``'s copy of its weight."""
        return self._readers.get((use.weight, use.copy), [])

    def _bias_scale_floor(self, weight: str, copy: CopyKey) -> np.ndarray | None:
        """Smallest weight scale per channel that keeps every int32 bias using this copy from saturating."""
        floor = None
        for node in self.plan.nodes:
            if node.bias is None or not node.activations or node.name not in self.uses:
                continue
            if (self.uses[node.name].weight, self.uses[node.name].copy) != (weight, copy):
                continue
            bias = np.abs(self.store.value(self.inits[node.bias]).astype(np.float64))
            input_scale = float(self.act_qparams[node.activations[0]].scale)
            need = bias / (input_scale * _INT32_MAX * 0.5)  # keep half the int32 range as headroom
            floor = need if floor is None else np.maximum(floor, need)
        if floor is not None and copy[0] is None:
            floor = np.asarray(floor.max())
        return floor

    def _round(self, use: WeightUse, values: np.ndarray, qp: QParams, pair_layout: str | None = None) -> np.ndarray:
        """The copy's integers: nearest rounding, or what the readers' rounding algorithm chose.

        ``pair_layout``: the integer kernel's weight pairs, when they must stay within the pair limit.
        """
        if self.algorithms is None:
            return quantize(values, qp)
        rounded = self.algorithms.round(use.weight, values, qp, self.readers(use), pair_layout)
        self._rounded[(use.weight, use.copy)] = (rounded.method, rounded.reason)
        return rounded.codes if rounded.codes is not None else quantize(values, qp)

    def _credit(self, use: WeightUse) -> None:
        """Record in the report the rounding the copy's readers got, or why they did not get what they asked."""
        method, reason = self._rounded.get((use.weight, use.copy), ("nearest", None))
        for reader in self.readers(use):
            if method != "nearest":
                self.report.algorithms.setdefault(reader.name, []).append(method)
            elif reason and reader.scheme.algorithms.rounding != "nearest":
                self.report.algorithm_notes[reader.name] = f"{reader.scheme.algorithms.rounding}: {reason}"
