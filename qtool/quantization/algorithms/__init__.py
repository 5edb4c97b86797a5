"""Weight algorithms that use calibration inputs, each a pure numpy module.

- :mod:`.patches`: per-node input statistics (patch Hessian, mean patch) from float input batches.
- :mod:`.gptq`: GPTQ rounding of a weight on a fixed scale and zero point.
- :mod:`.bias_correction`: analytic bias correction from the mean patch.
"""

from __future__ import annotations

from qtool.quantization.algorithms.rounding.bias_correction import bias_correction
from qtool.quantization.algorithms.rounding.gptq import (
    GptqResult,
    gptq_round,
    qparams_rows,
    rows_to_weight,
    weight_rows,
)
from qtool.quantization.algorithms.rounding.patches import ConvGeometry, InputStats, MatMulGeometry, input_stats

__all__ = [
    "ConvGeometry",
    "GptqResult",
    "InputStats",
    "MatMulGeometry",
    "bias_correction",
    "gptq_round",
    "input_stats",
    "qparams_rows",
    "rows_to_weight",
    "weight_rows",
]
