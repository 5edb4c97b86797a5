"""SmoothQuant: activation outliers of the plan's SmoothQuant nodes moved into their weights."""

from __future__ import annotations

import logging
from dataclasses import replace

from qtool.errors import QtoolError
from qtool.options import CalibrationOptions
from qtool.pipeline.data import tapped_pass
from qtool.pipeline.passes.base import PassInputs, PassResult
from qtool.pipeline.workspace import Workspace
from qtool.quantization.algorithms.transforms.smoothquant import ChannelMaxima, apply_smoothing, smoothing_nodes
from qtool.system.stages import stage

log = logging.getLogger(__name__)


class SmoothQuant:
    """Smooth with known channel maxima (a statistics file's), or measure them in a float pass."""

    name = "smoothquant"

    def __init__(self, *, whole_data: bool = False) -> None:
        self.whole_data = whole_data  # calibrate's: refuse options that read part of the data (shard, workers)

    def requires(self, workspace: Workspace, inputs: PassInputs) -> None:
        """Samples to measure the channel ranges, or a statistics file's, where the config smooths.

        With ``whole_data`` (calibrate), also the ranges of the whole data set: no ``--shard``, no workers.
        """
        if self.whole_data:
            _refuse_part_of_the_data(workspace, inputs.options)
        if (
            inputs.smoothing is None
            and inputs.data_dir is None
            and smoothing_nodes(workspace.plan(), workspace.prepared)
        ):
            raise QtoolError("smoothquant needs calibration samples or the channel ranges of a statistics file")

    def apply(self, workspace: Workspace, inputs: PassInputs) -> PassResult:
        """The smoothed model, the groups it smoothed and the maxima it used."""
        plan = workspace.plan()
        nodes = smoothing_nodes(plan, workspace.prepared)
        if not nodes:
            return PassResult(workspace.prepared, workspace.transforms)
        known = inputs.smoothing
        if known is None:
            assert inputs.data_dir is not None  # see requires
            tap = ChannelMaxima(sorted(set(nodes.values())))
            tapped_pass(workspace, inputs.data_dir, inputs.options, [tap], "SmoothQuant channel ranges")
            known = tap.maxima
        with stage("SmoothQuant"):
            model, report = apply_smoothing(workspace.prepared, workspace.weights, plan, known)
        for tensor, reason in report.skipped:
            log.info("SmoothQuant left %s as it is: %s", tensor, reason)
        return PassResult(model, replace(workspace.transforms, smoothed=report.groups, smoothing=known))


def _refuse_part_of_the_data(workspace: Workspace, options: CalibrationOptions) -> None:
    """Refuse workers or a shard when the config smooths: its channel ranges must be the whole data set's."""
    if options.workers is not None or options.scheduler is not None:
        without, kind = "--workers/--scheduler", "distributed"
    elif options.shard is not None:
        without, kind = "--shard", "sharded"
    else:
        return
    if smoothing_nodes(workspace.plan(), workspace.prepared):
        raise QtoolError(
            "smoothquant needs the channel ranges of the whole data set before calibrating: "
            f"calibrate without {without}",
            hint=f"or turn smoothquant off for {kind} calibration",
        )
