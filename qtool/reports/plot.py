"""Per-layer drop as a PNG (needs the optional matplotlib extra: ``pip install 'qtool-onnx[plot]'``).

Two panels, readable at any model size: an overview of every layer's drop in graph order, the
worst ones marked with their rank, and the ``top`` worst as labelled bars, labelled with the node
names the text report prints. Pairings marked uncertain are left out (and counted in the title).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import QtoolError
from qtool.evaluation.layers import layer_op
from qtool.graph.model_io import atomic_writer
from qtool.schemas.reports.compare import Layer

TOP_LAYERS = 20


@dataclass(frozen=True)
class LayerChart:
    """What the plot draws: every drop in graph order, and the worst ones with their labels."""

    drops: list[float]  # drop dB of each certain pairing, in graph order
    worst: list[tuple[int, str, float]]  # (index into drops, "node (op)" label, drop dB), worst first
    uncertain: int  # pairings left out


def chart_layers(layers: list[Layer], top: int = TOP_LAYERS) -> LayerChart:
    """The data of :func:`plot_layers`: certain pairings in graph order and the ``top`` largest drops."""
    certain = sorted((r for r in layers if not r.uncertain and r.drop_db is not None), key=lambda r: r.position)
    drops = [r.drop_db for r in certain if r.drop_db is not None]  # each of them
    ranked = sorted(range(len(certain)), key=lambda i: (-drops[i], certain[i].node))[:top]
    worst = [(i, f"{certain[i].node} ({layer_op(certain[i])})", drops[i]) for i in ranked]
    return LayerChart(drops, worst, len(layers) - len(certain))


def require_matplotlib() -> None:
    """Fail early, before any work, when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise QtoolError("--plot needs matplotlib", hint="pip install 'qtool-onnx[plot]'") from e


def plot_layers(layers: list[Layer], path: Path | str, top: int = TOP_LAYERS) -> None:
    """Draw the overview and the ``top`` worst drops; write a PNG atomically."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chart = chart_layers(layers, top)
    if not chart.drops:
        raise QtoolError("--plot: no paired layers to draw")
    shown = len(chart.worst)
    figure, (overview, bars) = plt.subplots(
        2, 1, figsize=(10.0, 3.0 + 0.28 * shown), gridspec_kw={"height_ratios": [2.6, 0.6 + 0.28 * shown]}
    )
    positions = range(len(chart.drops))
    overview.bar(positions, chart.drops, width=1.0, color="#2e86c1", linewidth=0)
    overview.axhline(0, color="#555555", linewidth=0.6)
    for rank, (index, _, drop) in enumerate(chart.worst[:10], start=1):
        if drop <= 0:
            break
        overview.annotate(str(rank), (index, drop), ha="center", va="bottom", fontsize=7, color="#c0392b")
    overview.set_xlim(-0.5, len(chart.drops) - 0.5)
    overview.set_xlabel(f"layer, in graph order ({len(chart.drops)} paired)")
    overview.set_ylabel("drop dB")
    left_out = f"; {chart.uncertain} uncertain pairing(s) left out" if chart.uncertain else ""
    overview.set_title(f"SQNR each layer loses (its inputs' SQNR minus its output's){left_out}", fontsize=10)
    labels = [f"{rank}. {label}" for rank, (_, label, _) in enumerate(chart.worst, start=1)]
    values = [drop for _, _, drop in chart.worst]
    bars.barh(range(shown), values, color=["#c0392b", *["#e59866"] * (shown - 1)])
    bars.set_yticks(range(shown), labels, fontsize=7)
    bars.invert_yaxis()
    bars.axvline(0, color="#555555", linewidth=0.6)
    for row, value in enumerate(values):
        bars.annotate(f"{value:.1f}", (value, row), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    bars.set_xlabel(f"drop dB, the {shown} worst layers")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    with atomic_writer(path) as f:
        f.write(buffer.getvalue())
