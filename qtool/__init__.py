"""qtool: calibrate, quantize and compare ONNX models.

The public API is re-exported here and imported lazily, so that ``qtool --help``
does not pay for importing onnx and onnxruntime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qtool._version import __version__

_EXPORTS = {
    "calibrate": "qtool.api",
    "quantize": "qtool.api",
    "compare": "qtool.api",
    "inspect": "qtool.api",
    "merge_stats": "qtool.api",
    "write_stats": "qtool.api",
    "ComparisonResult": "qtool.results",
    "QuantizeResult": "qtool.results",
    "CalibrationStats": "qtool.calibration.statistics",
    "QConfig": "qtool.config",
    "load_config": "qtool.config",
    "ExitCode": "qtool.errors",
    "CalibrationOptions": "qtool.options",
    "SearchOptions": "qtool.options",
    "EvaluationOptions": "qtool.options",
    "OutputOptions": "qtool.options",
    "QtoolError": "qtool.errors",
}

__all__ = [
    "CalibrationOptions",
    "CalibrationStats",
    "ComparisonResult",
    "EvaluationOptions",
    "ExitCode",
    "OutputOptions",
    "QConfig",
    "QtoolError",
    "QuantizeResult",
    "SearchOptions",
    "__version__",
    "calibrate",
    "compare",
    "inspect",
    "load_config",
    "merge_stats",
    "quantize",
    "write_stats",
]

if TYPE_CHECKING:
    from qtool.api import calibrate, compare, inspect, merge_stats, quantize, write_stats
    from qtool.calibration.statistics import CalibrationStats
    from qtool.config import QConfig, load_config
    from qtool.errors import ExitCode, QtoolError
    from qtool.options import CalibrationOptions, EvaluationOptions, OutputOptions, SearchOptions
    from qtool.results import ComparisonResult, QuantizeResult


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qtool' has no attribute {name!r}")
