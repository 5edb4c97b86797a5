"""Cross-layer equalization of the Conv chains whose nodes the plan marks for it (data-free)."""

from __future__ import annotations

import logging
from dataclasses import replace

from qtool.pipeline.passes.base import PassInputs, PassResult
from qtool.pipeline.workspace import Workspace
from qtool.quantization.algorithms.transforms.equalization import equalization_nodes, equalize
from qtool.system.stages import stage

log = logging.getLogger(__name__)


class Equalize:
    """Rescale Conv -> Conv pairs so that both weights use their grids well (records the pairs)."""

    name = "equalization"

    def requires(self, workspace: Workspace, inputs: PassInputs) -> None:
        """Data-free: nothing."""

    def apply(self, workspace: Workspace, inputs: PassInputs) -> PassResult:
        """The equalized model; statistics record the pairs, and ``quantize --stats`` checks them."""
        chosen = equalization_nodes(workspace.plan())
        if not chosen:
            return PassResult(workspace.prepared, replace(workspace.transforms, equalized=()))
        with stage("cross-layer equalization"):
            model, report = equalize(workspace.prepared, workspace.weights, chosen)
        for skip in report.skipped:
            log.info("equalization left %s -> %s alone: %s", skip.first, skip.second, skip.reason)
        pairs = tuple(f"{p.first} -> {p.second}" for p in report.pairs)
        return PassResult(model, replace(workspace.transforms, equalized=pairs))
