"""AWQ: input-channel scales moved into the plan's weight-only MatMul/Gemm weights."""

from __future__ import annotations

from dataclasses import replace

from qtool.pipeline.data import tapped_pass
from qtool.pipeline.passes.base import PassInputs, PassResult
from qtool.pipeline.workspace import Workspace
from qtool.quantization.algorithms.transforms.awq import (
    InputMoments,
    apply_awq,
    awq_readers,
    choose_awq_scales,
    within_budget,
)
from qtool.system.stages import stage

NO_DATA = "awq: needs calibration samples (--data, or --search-data with --stats)"
OVER_BUDGET = "awq: past the 1 GiB of activation second moments"


class Awq:
    """Measure each scaled input's mean |x| and second moment in a float pass, then scale.

    Without samples the nodes keep their weights, and the notes say why.
    """

    name = "awq"

    def requires(self, workspace: Workspace, inputs: PassInputs) -> None:
        """Nothing: without samples the nodes keep their weights, and the notes say why."""

    def apply(self, workspace: Workspace, inputs: PassInputs) -> PassResult:
        """The scaled model, the groups it scaled and, per node it could not scale, why."""
        readers, notes = awq_readers(workspace.plan(), workspace.prepared, workspace.weights)
        unchanged = workspace.prepared
        if not readers:
            return PassResult(
                unchanged, replace(workspace.transforms, awq_notes=notes) if notes else workspace.transforms
            )
        if inputs.data_dir is None:
            notes.update({r.node: NO_DATA for r in readers})
            return PassResult(unchanged, replace(workspace.transforms, awq_notes=notes))
        readers, over = within_budget(readers)
        notes.update({r.node: OVER_BUDGET for r in over})
        if not readers:
            return PassResult(unchanged, replace(workspace.transforms, awq_notes=notes))
        tap = InputMoments(sorted({r.tensor for r in readers}))
        tapped_pass(workspace, inputs.data_dir, inputs.options, [tap], "AWQ activation moments")
        with stage("AWQ"):
            scales, skipped = choose_awq_scales(readers, tap)
            model, report = apply_awq(workspace.prepared, workspace.weights, readers, scales)
            workspace.weights.release()  # the search read the weights; the scaled ones are new arrays
        for tensor, reason in [*skipped.items(), *report.skipped]:
            for reader in readers:
                if reader.tensor == tensor:
                    notes[reader.node] = reason if reason.startswith("awq") else f"awq: {reason}"
        return PassResult(model, replace(workspace.transforms, awq=report.groups, awq_notes=notes))
