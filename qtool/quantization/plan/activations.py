"""Activation scale and zero point of every tensor the plan quantizes, from calibration statistics."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qtool.errors import QtoolError
from qtool.numerics.qparams import QParams, compute_qparams, quant_type, within_ceiling
from qtool.observers import Observer
from qtool.observers.base import check_range
from qtool.quantization.plan.records import QuantPlan
from qtool.schemes import TensorScheme


def activation_qparams(rmin: np.ndarray, rmax: np.ndarray, scheme: TensorScheme, what: str) -> QParams:
    """Scale / zero point of an activation from its observed range."""
    return compute_qparams(rmin, rmax, quant_type(scheme.dtype), symmetric=scheme.symmetric, what=what)


def observer_bits(scheme: TensorScheme) -> int:
    """The bit width an activation's range is chosen for (an observer may clip more for fewer bits).

    fp8 keeps 3 (E4M3) or 2 (E5M2) mantissa bits at every magnitude, so clipping large values
    buys it little precision: its range is the one chosen for a fine 16-bit grid, in effect the
    observed extremes (TensorRT's fp8 recipe calibrates with the maximum too).
    """
    return 8 if scheme.dtype in ("int8", "uint8") else 16


OBSERVER_RANGES = "observer"  # each tensor's range as its observer chooses it (mse: the clipping with least error)
OBSERVED_EXTREMES = "extremes"  # the exact minimum and maximum seen (no clipping), where the observer kept them
RANGE_RULES = (OBSERVER_RANGES, OBSERVED_EXTREMES)


def plan_activation_qparams(
    plan: QuantPlan, observers: Mapping[str, Observer], ranges: str = OBSERVER_RANGES
) -> dict[str, QParams]:
    """QParams of each activation the plan quantizes, from its observer's range at the scheme's bit width.

    ``ranges``: :data:`OBSERVER_RANGES`, or :data:`OBSERVED_EXTREMES` for the unclipped range of every
    8-bit integer activation whose observer kept its extremes (clipping minimises each tensor's own error,
    but clipped values can carry what a network's later layers depend on: the placement choice measures both).

    Raises:
        QtoolError: a tensor the plan needs has no statistics (they came from another model or config).
    """
    result = {}
    for tensor, scheme in plan.activations.items():
        observer = observers.get(tensor)
        if tensor in plan.shared and (observer is None or observer.empty):
            continue  # takes its source's qparams, below (its own statistics, when present, are still checked)
        if observer is None or observer.empty:
            raise QtoolError(
                f"the statistics have no values for tensor '{tensor}'",
                hint="re-run qtool calibrate with the same model and config",
            )
        if observer.axis is not None:
            raise QtoolError(
                f"the statistics for tensor '{tensor}' are per channel (axis {observer.axis}); "
                "activations are quantized per tensor",
                hint="re-run qtool calibrate with the same model and config",
            )
        bits = observer_bits(scheme)
        try:
            lo, hi = observer.range(bits, scheme.symmetric)  # a histogram observer checks its extremes first
            check_range(lo, hi, None)
            unclipped = ranges == OBSERVED_EXTREMES and bits == 8 and scheme.observer is None  # a node's own: kept
            extremes = observer.observed_range() if unclipped else None
            if extremes is not None:
                lo, hi = extremes
        except ValueError as e:  # hand-edited statistics: computed ranges are always sound
            raise QtoolError(f"the statistics for tensor '{tensor}': {e}", hint="re-run qtool calibrate") from None
        result[tensor] = activation_qparams(lo, hi, scheme, what=f"tensor {tensor}")
        if tensor in plan.ceilings:  # a Clip's output: its grid within the Clip, which onnxruntime then drops
            result[tensor] = within_ceiling(result[tensor], plan.ceilings[tensor])
    for tensor in plan.shared:
        source = tensor
        while source in plan.shared:  # a chain of pass-through ops: every output takes the first input's
            source = plan.shared[source]
        result[tensor] = result[source]
    for branch in plan.branches:  # a body's tensors, observed on the samples and iterations that ran it
        for tensor, qp in plan_activation_qparams(branch.plan, observers, ranges).items():
            result.setdefault(tensor, qp)
    return result
