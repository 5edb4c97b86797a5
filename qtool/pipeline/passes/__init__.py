"""The rewrites of the float model before calibration, in the order they run."""

from __future__ import annotations

from pathlib import Path

from qtool.calibration.statistics import CalibrationStats
from qtool.pipeline.passes.awq import Awq
from qtool.pipeline.passes.base import Pass, PassInputs, PassResult, check_passes, run_passes
from qtool.pipeline.passes.equalize import Equalize
from qtool.pipeline.passes.smoothquant import SmoothQuant
from qtool.pipeline.passes.statistics_check import MatchesStatistics

# what statistics files describe: calibrate refuses to smooth with ranges of part of the data set (--shard, --workers)
BEFORE_CALIBRATION: tuple[Pass, ...] = (Equalize(), SmoothQuant(whole_data=True))
BEFORE_QUANTIZATION: tuple[Pass, ...] = (Equalize(), SmoothQuant(), Awq())  # AWQ reads its own float pass


def with_statistics(stats: CalibrationStats, path: Path | str) -> tuple[Pass, ...]:
    """The passes before quantizing with a statistics file, checked against the file after equalization.

    SmoothQuant then takes the file's channel ranges, and AWQ ``--search-data``.
    """
    return (Equalize(), MatchesStatistics(stats, path), SmoothQuant(), Awq())


__all__ = [
    "BEFORE_CALIBRATION",
    "BEFORE_QUANTIZATION",
    "Awq",
    "Equalize",
    "MatchesStatistics",
    "Pass",
    "PassInputs",
    "PassResult",
    "SmoothQuant",
    "check_passes",
    "run_passes",
    "with_statistics",
]
