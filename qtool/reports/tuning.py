"""What ``qtool tune`` tried and chose: a terminal table, a JSON document and a size/accuracy plot."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.table import Table

from qtool._version import __version__
from qtool.choice.tune.loop import Trial, pareto
from qtool.choice.tune.space import DESCRIPTIONS
from qtool.graph.model_io import atomic_writer
from qtool.reports.terminal import for_terminal
from qtool.results import TuneResult
from qtool.schemas import tune as doc


def _counts(trial: Trial) -> str:
    return ", ".join(f"{option} {count}" for option, count in trial.precisions.items())


def render_tune(console: Console, result: TuneResult) -> None:
    """Every verified candidate, the Pareto front marked, then the validation, the promise and the files."""
    chosen = next((i for i, t in enumerate(result.trials) if t is result.chosen), None)
    result = for_terminal(result)  # node and file names from the user's files: no raw control characters or markup
    table = Table(
        title=f"qtool tune {result.source.path}: {result.goal}, objective {result.objective}",
        title_justify="left",
    )
    metric = any(t.metric is not None for t in result.trials)
    timed = any(t.latency_ratio is not None for t in result.trials)
    bound = f"{result.confidence:.0%} bound"
    columns = ["#", "predicted dB", "size KiB", "compression", "selection dB", f"{bound} dB"]
    columns += ["metric", f"metric {bound}"] if metric else []
    columns += ["latency (99 %)"] if timed else []
    columns += ["precisions (nodes)", "verdict"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("precisions (nodes)", "verdict") else "right")
    for index, t in enumerate(result.trials, start=1):
        verdict = ("meets" if t.meets else t.note) + (", Pareto" if t.pareto else "")
        verdict = f"[bold]chosen[/bold], {verdict}" if index - 1 == chosen else verdict
        row = [
            str(index),
            f"{t.predicted_sqnr_db:.1f}",
            f"{t.size_bytes / 1024:.1f}",
            f"{t.compression_ratio:.2f}x",
            f"{t.sqnr_db:.2f}",
            f"{t.bound_db:.2f}",
        ]
        row += [_number(t.metric), _number(t.metric_bound)] if metric else []
        if timed:
            interval = t.latency_ratio_interval
            interval_text = f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else ""
            row += [f"{t.latency_ratio:.2f}x{interval_text}" if t.latency_ratio is not None else "-"]
        table.add_row(*row, _counts(t), verdict)
    console.print(table)
    used = sorted({option for t in result.trials for option in t.allocation.values()})
    console.print(
        "precisions: " + "; ".join(f"{option} = {DESCRIPTIONS.get(option, option)}" for option in used),
        highlight=False,
    )
    _print_measurement(console, result)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"wrote {result.output.path} and {result.config_out}", highlight=False)


def _number(value: float | None) -> str:
    return f"{value:.4g}" if value is not None else "-"


def _print_measurement(console: Console, result: TuneResult) -> None:
    """The sensitivity, which samples did what, each validation round, the written model and the promise."""
    s = result.sensitivity
    if s.cached:
        source = f"read from the tune cache ({s.cache_file}), measured earlier: {s.builds} single-node builds"
        console.print(f"sensitivity: {s.nodes} nodes, {source} in {s.seconds:.1f} s", highlight=False)
    else:
        console.print(
            f"sensitivity: {s.nodes} nodes, {s.builds} single-node builds in {s.seconds:.1f} s"
            + ("" if s.complete else " (cut short by the time budget)"),
            highlight=False,
        )
    validation = result.validation
    console.print(
        f"samples: EVAL split in two: {len(result.samples.selection)} select ({_files(result.samples.selection)}), "
        f"{len(validation.samples)} validate ({_files(validation.samples)}); each node measured on "
        f"{len(s.samples)} of the selection samples"
        + ("; each scored as a prefill and as the decode step after it" if result.samples.decode_steps else ""),
        highlight=False,
    )
    for number, round_ in enumerate(result.rounds, start=1):
        v, chosen = round_.validation, round_.choice
        console.print(
            f"validation {number}: candidate #{chosen.trial + 1} (chosen with a margin of {chosen.margin:.2f}): "
            f"{_figures(v.sqnr_db, v.bound_db, v.metric, v.metric_bound, result.validation_confidence)}: "
            + ("meets" if v.meets else "misses"),
            highlight=False,
        )
    w, v = result.written, validation
    status = "meets" if result.met else "does NOT meet"
    console.print(
        f"written: {w.compression_ratio:.2f}x smaller; on the selection samples "
        f"{_figures(w.sqnr_db, w.bound_db, w.metric, w.metric_bound, result.confidence)}; "
        f"validated {_figures(v.sqnr_db, v.bound_db, v.metric, v.metric_bound, result.validation_confidence)} "
        f"on {len(v.samples)} samples it never selected on: {status} {result.goal}",
        highlight=False,
    )
    how = ""
    if result.out_of_time:
        how = " (the time budget ran out: best so far)"
    elif result.stalled:
        how = " (the refinement stopped once its last candidates no longer made the model smaller)"
    console.print(
        f"{len(result.trials)} candidates verified in {result.seconds:.1f} s of a {result.time_budget:g} s budget"
        + how,
        highlight=False,
    )
    if result.met:
        console.print(f"promise: {promise(result)}", highlight=False)


def _files(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f", ... {names[-1]}" if len(names) > 3 else "")


def _figures(sqnr: float, bound: float, metric: float | None, metric_bound: float | None, confidence: float) -> str:
    level = f"{confidence:.1%}".replace(".0%", "%")
    if metric is not None:
        return f"metric {metric:.4g} ({level} bound {_number(metric_bound)})"
    return f"{sqnr:.2f} dB ({level} bound {bound:.2f} dB)"


def promise_db(result: TuneResult) -> float | None:
    """The SQNR the written model promises on new samples: the target it met (else the validated bound)."""
    v = result.validation
    if v.metric is not None:
        return None
    target = result.target_sqnr_db
    return min(target, v.bound_db) if target is not None and result.met else v.bound_db


def promise(result: TuneResult) -> str:
    """What the written model promises on new samples: the goal it met, judged on the validated bound."""
    v = result.validation
    figure = f"{result.goal}" if result.met else f"SQNR >= {v.bound_db:.2f} dB"
    if v.metric is not None and not result.met:
        figure = f"metric {_number(v.metric_bound)}"
    choices = max(1, round((1 - result.confidence) / max(1e-12, 1 - result.validation_confidence)))
    each = f"{result.validation_confidence:.1%}".replace(".0%", "%")
    bound = _figures(v.sqnr_db, v.bound_db, v.metric, v.metric_bound, result.validation_confidence)
    return (
        f"{figure} on a new set of {len(v.samples)} samples like EVAL's, with {result.confidence:.0%} confidence: "
        f"validated {bound} on samples it never selected on ({each} for each of the up to {choices} choices "
        f"validated keeps {result.confidence:.0%} for them all)"
    )


def missed_line(result: TuneResult) -> str:
    """Why the run ends with exit 1, in one line: the best reachable figure and what it costs."""
    v, written = result.validation, result.written
    figure = _figures(v.sqnr_db, v.bound_db, v.metric, v.metric_bound, result.validation_confidence)
    if not result.reachable and not result.out_of_time:
        reach = f"{v.bound_db:.1f} dB" if v.metric is None else f"{_number(v.metric_bound)}"
        return (
            f"no quantized model reaches {result.goal}: the most accurate one tried validates at {figure}, "
            f"{written.compression_ratio:.2f}x smaller (written); a target up to {reach} is reachable"
        )
    if not result.reachable:
        return (
            f"the time budget ran out before any model met {result.goal}: the most accurate so far validates at "
            f"{figure}, {written.compression_ratio:.2f}x smaller (written); give a larger --time-budget"
        )
    return (
        f"the written model validates at {figure} on {len(v.samples)} samples it never selected on: it does not "
        f"meet {result.goal} after {len(result.rounds)} choices (selection margin up to {result.margin:.2f}); "
        "give more EVAL samples or a lower target"
    )


def tune_to_dict(result: TuneResult) -> dict[str, Any]:
    """The ``qtool tune --json`` document (schema: :class:`qtool.schemas.tune.TuneReport`).

    The result's records are read under the report's names; the promise is the one thing written here.
    """
    document = SimpleNamespace(
        **vars(result),
        samples=result.samples,  # (a property: derived from the files the result names)
        schema_version=doc.TUNE_SCHEMA_VERSION,
        qtool_version=__version__,
        promise=promise(result) if result.met else None,
        promise_db=promise_db(result) if result.met else None,
    )
    return doc.TuneReport.model_validate(document, from_attributes=True).model_dump()


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
