"""Per-layer SQNR as a bar chart (needs the optional matplotlib extra: ``pip install 'qtool-onnx[plot]'``)."""

from __future__ import annotations

import io
from pathlib import Path

from qtool.errors import QtoolError
from qtool.evaluation.layers import SQNR_CAP_DB, LayerError
from qtool.graph.model_io import atomic_writer


def require_matplotlib() -> None:
    """Fail early, before any work, when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise QtoolError("--plot needs matplotlib", hint="pip install 'qtool-onnx[plot]'") from e


def plot_layers(layers: list[LayerError], path: Path | str, title: str = "per-layer SQNR") -> None:
    """Draw per-layer SQNR in graph order, the largest-drop layer highlighted; write a PNG atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise QtoolError("--plot needs matplotlib", hint="pip install 'qtool-onnx[plot]'") from e
    if not layers:
        raise QtoolError("--plot: no paired layers to draw")
    worst = max(layers, key=lambda r: r.drop_db)
    layers = sorted(layers, key=lambda r: r.position)  # graph order reads like the network
    values = [min(r.sqnr_db, SQNR_CAP_DB) for r in layers]
    colours = ["#c0392b" if r is worst else "#2e86c1" for r in layers]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.35 * len(layers)), 4.0))
    axis.bar(range(len(layers)), values, color=colours)
    axis.set_xticks(range(len(layers)), [r.tensor for r in layers], rotation=75, ha="right", fontsize=7)
    axis.set_ylabel("SQNR dB (higher is better)")
    axis.set_title(f"{title} — largest drop: {worst.node}")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    with atomic_writer(path) as f:
        f.write(buffer.getvalue())
