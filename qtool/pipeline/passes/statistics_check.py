"""The check a statistics file passes before it is used: the model it describes is the one the passes write."""

from __future__ import annotations

from pathlib import Path

from qtool.calibration.statistics import CalibrationStats
from qtool.errors import QtoolError
from qtool.pipeline.passes.base import PassInputs, PassResult
from qtool.pipeline.workspace import Workspace
from qtool.quantization.algorithms.transforms.smoothquant import smoothing_nodes


class MatchesStatistics:
    """Changes nothing: checks that the statistics describe the model the passes write.

    They must have been taken on the model as equalized, and with SmoothQuant's channel ranges where this config
    smooths: the check runs after equalization and before SmoothQuant.
    """

    name = "statistics check"

    def __init__(self, stats: CalibrationStats, path: Path | str) -> None:
        self.stats, self.path = stats, path

    def requires(self, workspace: Workspace, inputs: PassInputs) -> None:
        """Nothing before any pass: the equalization it checks is the pass before it."""

    def apply(self, workspace: Workspace, inputs: PassInputs) -> PassResult:
        """The model unchanged, once the statistics match it (QtoolError otherwise)."""
        _check(self.stats, workspace, self.path)
        return PassResult(workspace.prepared, workspace.transforms)


def _check(stats: CalibrationStats, ws: Workspace, path: Path | str) -> None:
    """Statistics describe the model as transformed when they were taken: the config must transform it alike.

    Called after equalization and before SmoothQuant, whose nodes it reads from the plan.
    """
    pairs = list(ws.transforms.equalized)
    if pairs != stats.equalized:
        if stats.equalized:
            then = f"with cross-layer equalization of {len(stats.equalized)} Conv pairs"
        else:
            then = "without cross-layer equalization"
        now = f"equalizes {len(pairs)}" if pairs else "equalizes none"
        raise QtoolError(
            f"{path} was calibrated {then}; this config {now}",
            hint="quantize with the config you calibrated with, or re-run qtool calibrate",
        )
    wanted = set(smoothing_nodes(ws.plan(), ws.prepared).values())
    if wanted and not stats.smoothing:
        raise QtoolError(
            f"{path} was calibrated without SmoothQuant, which this config turns on",
            hint="re-run qtool calibrate with this config",
        )
    if stats.smoothing and not wanted:
        raise QtoolError(
            f"{path} was calibrated with SmoothQuant, which this config leaves off",
            hint="quantize with the config you calibrated with, or re-run qtool calibrate",
        )
    missing = sorted(wanted - set(stats.smoothing))
    if missing:
        raise QtoolError(
            f"{path} has no SmoothQuant channel ranges for tensor '{missing[0]}'",
            hint="re-run qtool calibrate with this config",
        )
