"""Activation scale and zero point of every tensor the plan quantizes, from calibration statistics."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qtool.errors import QtoolError
from qtool.observers import Observer
from qtool.observers.base import check_range
from qtool.quantization.plan_types import QuantPlan
from qtool.quantization.qparams import QParams, compute_qparams, quant_type
from qtool.schemes import TensorScheme


def activation_qparams(rmin: np.ndarray, rmax: np.ndarray, scheme: TensorScheme, what: str) -> QParams:
    """Scale / zero point of an activation from its observed range."""
    return compute_qparams(rmin, rmax, quant_type(scheme.dtype), symmetric=scheme.symmetric, what=what)


def plan_activation_qparams(plan: QuantPlan, observers: Mapping[str, Observer]) -> dict[str, QParams]:
    """QParams of each activation the plan quantizes, from its observer's range at the scheme's bit width.

    Raises:
        QtoolError: a tensor the plan needs has no statistics (they came from another model or config).
    """
    result = {}
    for tensor, scheme in plan.activations.items():
        observer = observers.get(tensor)
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
        bits = 8 if scheme.dtype.endswith("8") else 16
        try:
            lo, hi = observer.range(bits, scheme.symmetric)  # a histogram observer checks its extremes first
            check_range(lo, hi, None)
        except ValueError as e:  # hand-edited statistics: computed ranges are always sound
            raise QtoolError(f"the statistics for tensor '{tensor}': {e}", hint="re-run qtool calibrate") from None
        result[tensor] = activation_qparams(lo, hi, scheme, what=f"tensor {tensor}")
    return result
