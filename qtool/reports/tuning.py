"""What ``qtool tune`` tried and chose: a terminal table, a JSON document and a size/accuracy plot."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from qtool._version import __version__
from qtool.graph.model_io import atomic_writer
from qtool.quantization.tune.loop import Trial, pareto
from qtool.results import TuneResult
from qtool.schemas import tune as doc

TUNE_SCHEMA_VERSION = 3  # 2: sensitivity.cached and sensitivity.cache_file; 3: sensitivity.samples


def _counts(trial: Trial) -> str:
    return ", ".join(f"{option} {count}" for option, count in trial.counts().items())


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def render_tune(console: Console, result: TuneResult) -> None:
    """Every verified candidate, the Pareto front marked, then the choice and what to run to reproduce it."""
    front = {id(t) for t in pareto(result.trials)}
    table = Table(
        title=f"qtool tune {result.source.path}: {result.goal}, objective {result.objective}", title_justify="left"
    )
    metric = any(t.metric is not None for t in result.trials)
    timed = any(t.latency_ratio is not None for t in result.trials)
    columns = ["#", "predicted dB", "size KiB", "compression", "SQNR dB"]
    columns += ["metric"] if metric else []
    columns += ["latency (99 %)"] if timed else []
    columns += ["precisions", "verdict"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("precisions", "verdict") else "right")
    for index, t in enumerate(result.trials, start=1):
        verdict = ("meets" if t.meets else t.note) + (", Pareto" if id(t) in front else "")
        verdict = f"[bold]chosen[/bold], {verdict}" if t is result.chosen else verdict
        row = [
            str(index),
            f"{t.predicted_db:.1f}",
            f"{t.size_bytes / 1024:.1f}",
            f"{t.compression:.2f}x",
            f"{t.sqnr_db:.2f}",
        ]
        row += [f"{t.metric:.4g}" if t.metric is not None else "-"] if metric else []
        if timed:
            interval = f" ({t.latency_interval[0]:.2f}-{t.latency_interval[1]:.2f})" if t.latency_interval else ""
            row += [f"{t.latency_ratio:.2f}x{interval}" if t.latency_ratio is not None else "-"]
        table.add_row(*row, _counts(t), verdict)
    console.print(table)
    s = result.sensitivity
    if s.cached:
        source = f"read from the tune cache ({s.cache_file}), measured earlier: {s.builds} single-node builds"
        console.print(f"sensitivity: {result.nodes} nodes, {source} in {s.seconds:.1f} s", highlight=False)
    else:
        console.print(
            f"sensitivity: {result.nodes} nodes, {s.builds} single-node builds in {s.seconds:.1f} s"
            + ("" if s.complete else " (cut short by the time budget)"),
            highlight=False,
        )
    status = "meets" if result.met else "does NOT meet"
    written = result.written
    scored = f", metric {written.metric:.4g}" if written.metric is not None else ""
    console.print(
        f"written: {written.compression:.2f}x smaller, {written.sqnr_db:.2f} dB{scored}, {status} {result.goal}; "
        f"{len(result.trials)} candidates verified in {result.seconds:.1f} s"
        + (" (the time budget ran out: best so far)" if result.out_of_time else ""),
        highlight=False,
    )
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"wrote {result.output.path} and {result.config_out}", highlight=False)


def _trial(t: Trial, chosen: bool, front: bool) -> doc.TuneTrial:
    return doc.TuneTrial(
        size_bytes=t.size_bytes,
        compression_ratio=t.compression,
        sqnr_db=_finite(t.sqnr_db),
        metric=t.metric,
        latency_ratio=t.latency_ratio,
        latency_ratio_interval=list(t.latency_interval) if t.latency_interval else None,
        predicted_sqnr_db=_finite(t.predicted_db),
        meets=t.meets,
        note=t.note,
        chosen=chosen,
        pareto=front,
        precisions=t.counts(),
        allocation=dict(sorted(t.allocation.items())),
    )


def tune_to_dict(result: TuneResult) -> dict[str, Any]:
    """The ``qtool tune --json`` document (schema: :class:`qtool.schemas.tune.TuneReport`)."""
    front = {id(t) for t in pareto(result.trials)}
    s = result.sensitivity
    source, output = result.source, result.output
    report = doc.TuneReport(
        schema_version=TUNE_SCHEMA_VERSION,
        qtool_version=__version__,
        model=doc.TunedFile(path=source.path, sha256=source.sha256, bytes=source.size_bytes),
        output=doc.TunedFile(path=output.path, sha256=output.sha256, bytes=output.size_bytes),
        config_out=result.config_out,
        goal=result.goal,
        objective=result.objective,
        met=result.met,
        out_of_time=result.out_of_time,
        seconds=result.seconds,
        sensitivity=doc.TuneSensitivity(
            nodes=result.nodes,
            builds=s.builds,
            seconds=s.seconds,
            complete=s.complete,
            cached=s.cached,
            cache_file=s.cache_file,
            samples=list(s.samples),
            noise_to_signal={node: {o: _finite(v) for o, v in row.items()} for node, row in sorted(s.nsr.items())},
            measured={node: options for node, options in sorted(s.measured.items())},
        ),
        written=_trial(result.written, True, False),
        trials=[_trial(t, t is result.chosen, id(t) in front) for t in result.trials],
        notes=list(result.notes),
    )
    return report.model_dump()


def plot_trials(result: TuneResult, path: Path | str) -> None:
    """Size against accuracy of every verified candidate: the Pareto front joined, the choice ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.0, 4.5))
    accuracy = [t.metric if t.metric is not None else t.sqnr_db for t in result.trials]
    sizes = [t.size_bytes / 1024 for t in result.trials]
    colours = ["#2e86c1" if t.meets else "#aab7b8" for t in result.trials]
    axis.scatter(sizes, accuracy, c=colours, zorder=3)
    front = pareto(result.trials)
    axis.plot(
        [t.size_bytes / 1024 for t in front],
        [t.metric if t.metric is not None else t.sqnr_db for t in front],
        color="#2e86c1",
        linewidth=1,
        zorder=2,
        label="Pareto front",
    )
    chosen = result.chosen
    axis.scatter(
        [chosen.size_bytes / 1024],
        [chosen.metric if chosen.metric is not None else chosen.sqnr_db],
        s=160,
        facecolors="none",
        edgecolors="#c0392b",
        linewidths=2,
        zorder=4,
        label="chosen",
    )
    axis.set_xlabel("size KiB (smaller is better)")
    axis.set_ylabel("metric" if chosen.metric is not None else "SQNR dB (worst output)")
    axis.set_title(f"qtool tune: {result.goal}", fontsize=10)
    axis.legend(loc="lower right", fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    with atomic_writer(path) as f:
        f.write(buffer.getvalue())
