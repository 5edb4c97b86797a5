"""The rewrites of the float model before calibration, in the order they run."""

from __future__ import annotations

from qtool.pipeline.passes.awq import Awq
from qtool.pipeline.passes.base import Pass, PassInputs, PassResult, run_passes
from qtool.pipeline.passes.equalize import Equalize
from qtool.pipeline.passes.smoothquant import SmoothQuant

BEFORE_CALIBRATION: tuple[Pass, ...] = (Equalize(), SmoothQuant())  # what statistics files describe
BEFORE_QUANTIZATION: tuple[Pass, ...] = (*BEFORE_CALIBRATION, Awq())  # AWQ reads its own float pass

__all__ = [
    "BEFORE_CALIBRATION",
    "BEFORE_QUANTIZATION",
    "Awq",
    "Equalize",
    "Pass",
    "PassInputs",
    "PassResult",
    "SmoothQuant",
    "run_passes",
]
