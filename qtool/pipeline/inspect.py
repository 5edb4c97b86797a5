"""The ``inspect`` pipeline: the plan quantize would follow, and the exact size of its model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from qtool._version import __version__
from qtool.options import CalibrationOptions
from qtool.pipeline.calibrate import observe
from qtool.pipeline.workspace import Workspace
from qtool.quantization.activations import activation_qparams
from qtool.quantization.inspection import Inspection, inspect_plan
from qtool.quantization.rewrite import insert_qdq
from qtool.quantization.rewrite_report import RewriteReport
from qtool.quantization.saturation import FITTED


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
    plan = ws.plan(elements=elements)
    result = inspect_plan(ws.source.path, ws.source.size_bytes, ws.prepared, plan, config)
    # The exact size comes from doing the rewrite with placeholder activation ranges: only scale values
    # differ from the real run, and they take the same bytes.
    placeholder = {
        tensor: activation_qparams(np.asarray(-1.0), np.asarray(1.0), scheme, what=tensor)
        for tensor, scheme in plan.activations.items()
    }
    rewritten, report = insert_qdq(ws.prepared, plan, placeholder, ws.weights)
    rewritten.producer_name, rewritten.producer_version = "qtool", __version__
    rows = [replace(row, weight_form=_form_text(report, row.name)) for row in result.rows]
    return replace(result, rows=rows, rewritten_bytes=ws.weights.embedded_size(rewritten))


def _form_text(report: RewriteReport, node: str) -> str:
    """How the rewrite stored an integer node's 8-bit weight, with what a fit cost ("" for other nodes)."""
    form = report.weight_forms.get(node, "")
    fit = report.pair_fits.get(node)
    if form == FITTED and fit is not None:
        return f"{form}: {fit.rescaled}/{fit.columns} channels, {fit.bits_lost:.2f} bits"
    return form
