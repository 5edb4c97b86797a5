"""The ``inspect`` pipeline: the plan quantize would follow, and the exact size of its model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from qtool._version import __version__
from qtool.numerics.saturation import FITTED
from qtool.options import CalibrationOptions
from qtool.pipeline.calibrate import observe
from qtool.pipeline.workspace import Workspace
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.emit.rewrite import insert_qdq
from qtool.quantization.plan.activations import activation_qparams
from qtool.quantization.plan.inspection import Inspection, inspect_plan
from qtool.quantization.plan.records import QuantPlan
from qtool.schemes import CPU_TARGETS


def inspect(ws: Workspace, data_dir: Path | str | None) -> Inspection:
    """Per-node schemes, float nodes and the predicted size of ``ws``'s model under its config.

    With ``data_dir``, its first calibration batch gives the tensor sizes that dynamic shapes leave
    open, per sample as quantize counts them, so ``placement: auto`` decides as quantize will.
    """
    config = ws.config
    elements = ws.sizes()
    if data_dir is not None:
        first_batch = min(config.calibration.batch_size, config.calibration.limit or config.calibration.batch_size)
        sizing = CalibrationOptions(observer="minmax", batch_size=config.calibration.batch_size, limit=first_batch)
        elements.update(observe(ws, data_dir, sizing).elements)
    rules = ws.plan(elements=elements)
    note, plan = _as_quantize_places(ws, rules, elements, measured=data_dir is not None)
    result = inspect_plan(ws.source.path, ws.source.size_bytes, ws.prepared, plan, config)
    if plan is not rules:  # the rule that chose each node's scheme is still the config's; its placement is not
        decided = {n.name: n.scheme.rule for n in rules.every_node()}
        guess = {
            n.name: n.reason for n in rules.every_node() if n.placement == "integer" and n.scheme.placement == "auto"
        }
        result = replace(
            result,
            rows=[
                row.model_copy(
                    update={
                        "rule": decided.get(row.name, row.rule),
                        "placement_reason": (
                            f"storage: no samples to measure integer kernels (the rules: {guess[row.name]})"
                            if row.name in guess
                            else row.placement_reason
                        ),
                    }
                )
                for row in result.rows
            ],
        )
    result = replace(result, placement_note=note, prepare=ws.report)
    # The exact size comes from doing the rewrite with placeholder activation ranges: only scale values
    # differ from the real run, and they take the same bytes.
    placeholder = {
        tensor: activation_qparams(np.asarray(-1.0), np.asarray(1.0), scheme, what=tensor)
        for tensor, scheme in plan.every_activation().items()
    }
    rewritten, report = insert_qdq(ws.prepared, plan, placeholder, ws.weights)
    rewritten.producer_name, rewritten.producer_version = "qtool", __version__
    rows = [row.model_copy(update={"weight_form": _pair_guard_text(report, row.name)}) for row in result.rows]
    return replace(result, rows=rows, rewritten_bytes=ws.weights.embedded_size(rewritten))


def _as_quantize_places(
    ws: Workspace, plan: QuantPlan, elements: dict[str, int], *, measured: bool
) -> tuple[str, QuantPlan]:
    """The plan as quantize writes it, and a note on how its placement is decided (the same rule as quantize).

    Without samples, quantize keeps the nodes the rules would put on integer kernels storage-only
    (nothing measures whether they pay off): inspect shows that. With samples, quantize measures
    candidate placements and may keep another one than the rules' guess shown here: the note says so.
    """
    config = ws.config
    guessed = [n.name for n in plan.every_node() if n.placement == "integer" and n.scheme.placement == "auto"]
    if config.target not in CPU_TARGETS or not guessed or config.accuracy.target_sqnr_db is None:
        return "", plan
    if measured:
        return (
            f"the rules' guess: {len(guessed)} nodes on integer kernels. quantize --data measures the candidate "
            "placements (these rules, every auto node integer, every auto node storage-only) on this CPU and "
            "may keep another: its summary shows the one kept",
            plan,
        )
    storage = ws.plan(replace(config, auto_placement="storage"), elements=elements)
    return (
        f"as quantize writes it without samples: the {len(guessed)} nodes the rules would put on integer kernels "
        "stay storage-only (fp32 speed); with --data, quantize measures whether integer kernels pay off here",
        storage,
    )


def _pair_guard_text(report: RewriteReport, node: str) -> str:
    """How the rewrite stored an integer node's 8-bit weight against pair saturation, with what a fit cost."""
    guard = report.weight_forms.get(node, "")  # "" for other nodes
    fit = report.pair_fits.get(node)
    if guard == FITTED and fit is not None:
        return f"{guard}: {fit.rescaled}/{fit.columns} channels, {fit.bits_lost:.2f} bits"
    return guard
