"""The side-by-side of ``quantize --vs-onnxruntime`` as a terminal table."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from qtool.schemas.reports.quantize import PeerReport


def _speedup(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None and math.isfinite(value) else ""


def render_peer(console: Console, peer: PeerReport) -> None:
    """fp32, qtool's model and onnxruntime's of the same file: size, worst output, speed-ups; then the notes.

    ``peer``'s strings are printed as they are: the caller made them printable (:func:`for_terminal`).
    """
    where = "held-out samples" if peer.held_out else "calibration samples (not held out)"
    table = Table(
        title=f"beside onnxruntime's quantize_static ({peer.recipe}), same file and calibration samples",
        title_justify="left",
    )
    for column in ("model", "size MiB", "worst output dB", "speed-up 1 thread", "speed-up every core"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in peer.rows:
        sqnr = f"{row.worst_sqnr_db:.2f}" if row.worst_sqnr_db is not None else ""
        table.add_row(
            row.model,
            f"{row.bytes / 2**20:.2f}",
            sqnr,
            _speedup(row.speedup_one_thread),
            _speedup(row.speedup_all_threads),
        )
    console.print(table)
    console.print(
        f"worst output SQNR on {peer.samples} {where}; speed-ups: fp32 time over the model's, medians of "
        f"{peer.runs} interleaved rounds per thread setting; CPU: {peer.cpu}",
        highlight=False,
    )
    for note in peer.notes:
        console.print(f"[yellow]note[/yellow] {note}", highlight=False)
