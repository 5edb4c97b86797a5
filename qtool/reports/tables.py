"""Rich tables for people, built from the same result records as the JSON documents."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from qtool.evaluation.closed_loop import closed_loop_lines
from qtool.evaluation.language_model import language_model_lines
from qtool.evaluation.layers import largest_drop, layer_drop, layer_op
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.plan.inspection import Inspection
from qtool.reports.ci import improved
from qtool.reports.peer_table import render_peer
from qtool.reports.placement_tables import render_choice, render_search
from qtool.reports.prepared import prepared_line
from qtool.reports.terminal import for_terminal
from qtool.results import ComparisonResult, QuantizeResult
from qtool.schemas.reports.compare import Baseline, Latency, Layer
from qtool.schemas.reports.doctor import DoctorReport


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _db(value: float) -> str:
    return "inf" if math.isinf(value) and value > 0 else f"{value:.2f}"


def _verdict(passed: bool) -> str:
    return "[green]PASS[/green]" if passed else "[bold red]FAIL[/bold red]"


def _value(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def _render_baseline(console: Console, baseline: Baseline) -> None:
    verdict = "[red]regressed[/red]" if baseline.regressed else "[green]no regression[/green]"
    table = Table(title=f"against the baseline {baseline.path}: {verdict}", title_justify="left")
    for column in ("metric", "baseline", "now", "change", ""):
        table.add_column(column, justify="left" if column in ("metric", "") else "right")
    for c in baseline.changes:
        change = "" if c.change is None else (f"{c.change:+.2f} dB" if c.metric == "sqnr" else f"{c.change:+.3f}")
        mark = "[red]regressed[/red]" if c.regressed else ("[green]better[/green]" if improved(c) else "")
        note = "; ".join(part for part in (mark, c.note) if part)
        table.add_row(c.metric, _opt(c.baseline), _opt(c.current), change, note)
    console.print(table)
    if not baseline.same_reference:
        console.print("[yellow]the baseline measured another reference model[/yellow]", highlight=False)


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_comparison(console: Console, result: ComparisonResult, title: str = "qtool compare") -> None:
    """Print size, accuracy, per-layer, latency and gate tables."""
    result = for_terminal(result)  # names from the user's files: no raw control characters or markup
    _render_size(console, result, title)
    _render_accuracy(console, result)
    if result.layers is not None:
        render_layers(console, result.layers)
    for lat in result.latency:
        _render_latency(console, lat)
    for provider, reason in result.skipped_providers:
        console.print(f"[yellow]latency on {provider} skipped[/yellow]: {reason}", highlight=False)
    if result.baseline is not None:
        _render_baseline(console, result.baseline)
    if result.gates:
        gates = Table(title="gates", title_justify="left")
        for column in ("gate", "measured", "verdict"):
            gates.add_column(column)
        for g in result.gates:
            gates.add_row(g.gate, _value(g.measured) + (f" ({g.note})" if g.note else ""), _verdict(g.passed))
        console.print(gates)


def _render_size(console: Console, result: ComparisonResult, title: str) -> None:
    size = Table(title=title, title_justify="left", show_header=True)
    size.add_column("")
    size.add_column("reference", justify="right")
    size.add_column("candidate", justify="right")
    size.add_row("file", result.reference.path, result.candidate.path)
    size.add_row("size", _bytes(result.reference.size_bytes), _bytes(result.candidate.size_bytes))
    size.add_row("compression", "", f"[bold]{result.compression_ratio:.2f}x[/bold]")
    console.print(size)


def _render_accuracy(console: Console, result: ComparisonResult) -> None:
    """The outputs' errors, where they were scored, and the task's own figures."""
    acc = Table(title=f"accuracy vs reference, {result.samples} samples of {result.data_dir}", title_justify="left")
    for column in ("output", "SQNR dB", "cosine", "MSE", "max |err|"):
        acc.add_column(column, justify="left" if column == "output" else "right")
    rows = [*result.outputs, result.overall] if len(result.outputs) > 1 else result.outputs
    for m in [*rows, *([result.judged] if result.judged is not None else [])]:
        acc.add_row(m.name, _db(m.sqnr_db), f"{m.cosine:.6f}", f"{m.mse:.3e}", f"{m.max_abs_error:.3e}")
    console.print(acc)
    if result.judged_note:
        console.print(f"judged (the gates' outputs): {result.judged_note.removeprefix('the target judges ')}")
    if result.calibration_data:
        console.print(
            "[yellow]scored on the calibration samples[/yellow]: not held out, so optimistic "
            "(give --eval DIR, or compare other samples)",
            highlight=False,
        )
    console.print(f"task: {result.task}", highlight=False)
    for a in result.classification:
        console.print(f"  {a.output}: top-1 agreement {a.top1:.2%}, top-5 {a.top5:.2%} over {a.rows} rows")
    for b in result.boxes:
        console.print(f"  {b.output}: mean box IoU {b.mean_iou:.4f} over {b.boxes} boxes")
    if result.language_model is not None:
        console.print(f"language model ('{result.language_model.logits}'):", highlight=False)
        for line in language_model_lines(result.language_model):
            console.print(f"  {line}", highlight=False)
    if result.closed_loop is not None:
        first, *rest = closed_loop_lines(result.closed_loop)
        console.print(first, highlight=False)
        for line in rest:
            console.print(f"  {line}", highlight=False)


def _render_latency(console: Console, lat: Latency) -> None:
    """One provider's latency table, its speed-up and what else it measured."""
    threads = lat.threads if lat.threads else "default"
    provider = lat.provider.removesuffix("ExecutionProvider")
    table = Table(title=f"latency, {provider}, threads={threads}, {lat.reference.runs} runs", title_justify="left")
    for column in ("model", "median ms", "p90 ms", "p99 ms"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for label, stats in (("reference", lat.reference), ("candidate", lat.candidate)):
        table.add_row(label, f"{stats.median_ms:.3f}", f"{stats.p90_ms:.3f}", f"{stats.p99_ms:.3f}")
    colour = "green" if lat.speedup >= 1 else "yellow"
    interval = lat.speedup_interval
    spread = f"(99 % interval {interval[0]:.2f}-{interval[1]:.2f}x)" if interval else "(too few runs for an interval)"
    console.print(table)
    console.print(f"  speed-up: [{colour}]{lat.speedup:.2f}x[/{colour}] {spread}", highlight=False)
    if lat.candidate_sqnr_db is not None:
        console.print(
            f"  accuracy on {provider}: worst output {lat.candidate_sqnr_db:.2f} dB against the float reference",
            highlight=False,
        )
    if lat.setup_ms and lat.provider != "CPUExecutionProvider":  # on the CPU it is noise; JSON keeps it
        what = "engine build" if lat.provider == "TensorrtExecutionProvider" else "session setup"
        bound = "; inputs and outputs bound on the device" if lat.io_binding else ""
        console.print(
            f"  {what} and first run, apart from the above: reference {lat.setup_ms[0]:.0f} ms, "
            f"candidate {lat.setup_ms[1]:.0f} ms{bound}",
            highlight=False,
        )


def render_layers(console: Console, layers: list[Layer], show: int = 15) -> None:
    """Per-layer SQNR, worst first, and the layer that introduces the largest drop."""
    layers = for_terminal(layers)  # names from the user's files: no raw control characters or markup
    table = Table(
        title=f"per-layer error, worst {min(show, len(layers))} of {len(layers)} tensors", title_justify="left"
    )
    for column in ("tensor", "node", "op", "SQNR dB", "drop dB", "MSE"):
        table.add_column(column, justify="right" if column in ("SQNR dB", "drop dB", "MSE") else "left")
    for r in layers[:show]:
        table.add_row(r.tensor, r.node, layer_op(r), _db(r.sqnr_db), layer_drop(r), f"{r.mse:.3e}")
    console.print(table)
    uncertain = [r for r in layers if r.uncertain]
    if uncertain:
        console.print(
            f"{len(uncertain)} pairing(s) uncertain, no drop given: "
            + "; ".join(f"{r.tensor} ({r.uncertain})" for r in uncertain[:3]),
            highlight=False,
        )
    drop = largest_drop(layers)
    if drop is not None:
        console.print(
            f"largest drop: [bold]{drop.node}[/bold] ({drop.op_type}) takes {drop.tensor} from "
            f"{drop.input_sqnr_db:.1f} dB at its inputs to {_db(drop.sqnr_db)} dB ({drop.drop_db:.1f} dB lost)",
            highlight=False,
        )


def render_observers(console: Console, rows: list[dict[str, Any]]) -> None:
    """Print the observer listing."""
    rows = for_terminal(rows)  # names from the user's files: no raw control characters or markup
    table = Table(title="observers", title_justify="left")
    for column in ("name", "source", "options (defaults)", "what it does"):
        table.add_column(column)
    for row in rows:
        options = row["options"]
        shown = "see the plugin" if options is None else ", ".join(f"{k}={v}" for k, v in options.items()) or "-"
        table.add_row(row["name"], row["source"], shown, row["summary"])
    console.print(table)


def render_inspection(console: Console, result: Inspection) -> None:
    """Print the per-node plan, what stays float, and the predicted compression."""
    result = for_terminal(result)  # names from the user's files: no raw control characters or markup
    table = Table(title=f"qtool inspect {result.model_path}", title_justify="left")
    columns = ["node", "op", "rule", "weight", "activation", "runs as"]
    algorithms = any(r.algorithms for r in result.rows)
    columns += ["algorithms"] if algorithms else []
    forms = any(r.weight_form for r in result.rows)
    columns += ["weight form"] if forms else []
    numbers = {
        "elements": [f"{r.weight_elements:,}" for r in result.rows],
        "float B": [f"{r.float_bytes:,}" for r in result.rows],
        "quantized B": [f"{r.quantized_bytes:,}" for r in result.rows],
    }
    totals = {
        "elements": f"{sum(r.weight_elements for r in result.rows):,}",
        "float B": f"{sum(r.float_bytes for r in result.rows):,}",
        "quantized B": f"{sum(r.quantized_bytes for r in result.rows):,}",
    }
    for column in columns:  # words wrap on a narrow terminal (names fold): numbers never do
        table.add_column(column, overflow="fold")
    for column, values in numbers.items():
        width = max([len(column), len(totals[column]), *(len(v) for v in values)])
        table.add_column(column, justify="right", no_wrap=True, min_width=width)
    for r in result.rows:
        table.add_row(
            r.name,
            r.op_type,
            r.rule,
            r.weight,
            r.activation,
            r.placement,
            *([", ".join(r.algorithms) or "-"] if algorithms else []),
            *([r.weight_form or "-"] if forms else []),
            f"{r.weight_elements:,}",
            f"{r.float_bytes:,}",
            f"{r.quantized_bytes:,}",
        )
    table.add_section()
    table.add_row("total", *[""] * (len(columns) - 1), *totals.values())
    console.print(table)
    console.print(
        f"model {_bytes(result.model_bytes)} -> predicted {_bytes(result.predicted_bytes)}, "
        f"compression [bold]{result.predicted_ratio:.2f}x[/bold]"
    )
    if result.placement_note:
        console.print(f"[yellow]placement[/yellow] {result.placement_note}", highlight=False)
    _render_inspection_reasons(console, result)
    if result.passthrough:
        listed = ", ".join(f"{op} x{count}" for op, count in result.passthrough.items())
        console.print(f"passed through untouched (not quantized by qtool): {listed}")
    prepared = prepared_line(result.prepare) if result.prepare is not None else None
    if prepared:
        console.print(prepared)


def _render_inspection_reasons(console: Console, result: Inspection) -> None:
    """Why each node runs as it does (and the predicted kernel), then what stays float and why."""
    reasons = [r for r in result.rows if r.placement_reason]
    if reasons:
        placement = Table(title="placement and the kernel onnxruntime (CPU) is predicted to run", title_justify="left")
        for column in ("node", "runs as", "why", "predicted kernel", "because"):
            placement.add_column(column, overflow="fold")
        for r in reasons:
            c = "red" if not r.integer_kernel and r.placement == "integer" else "green"
            placement.add_row(r.name, r.placement, r.placement_reason, f"[{c}]{r.predicted_kernel}[/]", r.kernel_reason)
        console.print(placement)
    if result.kept_float:
        kept = Table(title="kept in float", title_justify="left")
        for column in ("node", "op", "why"):
            kept.add_column(column, overflow="fold")
        ops = {name: op for name, op, _ in result.kept_float}
        ops_by_reason: dict[str, set[str]] = {}
        for _, op, why in result.kept_float:
            ops_by_reason.setdefault(why, set()).add(op)
        for nodes, why in grouped_by_reason([(name, why) for name, _, why in result.kept_float]):
            kept.add_row(nodes, ops.get(nodes) or ", ".join(sorted(ops_by_reason[why])), why)
        console.print(kept)


GROUPED_AFTER = 3  # more nodes than this kept float for the same reason: one line for them all (--json lists each)


def grouped_by_reason(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(node, reason) pairs; a reason many nodes share (a decoder's shape Gathers) is one line naming two."""
    by_reason: dict[str, list[str]] = {}
    for node, reason in pairs:
        by_reason.setdefault(reason, []).append(node)
    lines = []
    for node, reason in pairs:
        nodes = by_reason[reason]
        if len(nodes) <= GROUPED_AFTER:
            lines.append((node, reason))
        elif node == nodes[0]:
            lines.append((f"{len(nodes)} nodes ({nodes[0]}, {nodes[1]}, ...)", reason))
    return lines


def _render_algorithms(console: Console, r: RewriteReport) -> None:
    """Which algorithms ran on how many nodes (``--json`` lists them per node), and why some could not."""
    counts = Counter(name for names in r.algorithms.values() for name in names)
    if counts:
        console.print("algorithms: " + ", ".join(f"{name} on {count} nodes" for name, count in counts.items()))
    reasons = Counter(r.algorithm_notes.values())
    for reason, count in reasons.most_common():
        console.print(f"[yellow]not applied[/yellow] to {count} node{'s' if count > 1 else ''}: {reason}")


def _render_weight_forms(console: Console, r: RewriteReport) -> None:
    """How the integer kernels' 8-bit weights are stored: one line, fitted channels' cost included."""
    counts = Counter(r.weight_forms.values())
    if not counts:
        return
    parts = [f"{count} {form}" for form, count in counts.most_common()]
    lost = [fit.bits_lost for node, fit in r.pair_fits.items() if node in r.weight_forms and fit.coarsest > 1.0]
    fitted = f" (fitted to the AVX2 pair limit, at most {max(lost):.2f} bits coarser)" if lost else ""
    console.print(f"integer weights: {', '.join(parts)}{fitted}", highlight=False)


def render_quantize(console: Console, result: QuantizeResult) -> None:
    """Print what quantize did, then the comparison when there is one."""
    result = for_terminal(result)  # names from the user's files: no raw control characters or markup
    r = result.rewrite
    console.print(
        f"[green]wrote[/green] {result.output.path}: {len(r.quantized_nodes)} nodes quantized "
        f"({len(r.quantized_weights)} weights, {len(r.quantized_biases)} biases, "
        f"{len(r.quantized_activations)} activations"
        f"{f', {len(r.chained_nodes)} ops chained between integer kernels' if r.chained_nodes else ''}), "
        f"{_bytes(result.source.size_bytes)} -> {_bytes(result.output.size_bytes)}, "
        f"compression [bold]{result.compression_ratio:.2f}x[/bold]"
    )
    if result.data_files:
        console.print(f"weights written as external data to {', '.join(result.data_files)}", highlight=False)
    if result.placements:
        console.print("runs as: " + ", ".join(f"{count} {kind}" for kind, count in result.placements.items()))
    if result.kernels:
        listed = ", ".join(f"{count} {kernel}" for kernel, count in result.kernels.items())
        console.print(f"onnxruntime (CPU) is predicted to run: {listed}", highlight=False)
    if result.boundaries and any(result.boundaries.values()):
        q, dq = result.boundaries["QuantizeLinear"], result.boundaries["DequantizeLinear"]
        left = f"float boundaries left: {q} QuantizeLinear, {dq} DequantizeLinear (activations)"
        console.print(left, highlight=False)
    _render_algorithms(console, r)
    _render_weight_forms(console, r)
    prepared = prepared_line(result.prepare)
    if prepared:
        console.print(prepared)
    for nodes, reason in grouped_by_reason(result.skipped):
        console.print(f"[yellow]kept in float[/yellow] {nodes}: {reason}")
    if r.passthrough:
        listed = ", ".join(f"{op} x{count}" for op, count in r.passthrough.items())
        console.print(f"passed through untouched (not quantized by qtool): {listed}", highlight=False)
    if result.search is not None:
        render_search(console, result.search)
    if result.placement_choice is not None:
        render_choice(console, result.placement_choice, result.comparison)
    for note in result.notes:
        console.print(f"[yellow]note[/yellow] {note}")
    if result.comparison is not None:
        render_comparison(console, result.comparison, title="float vs quantized")
    if result.peer is not None:
        render_peer(console, result.peer)


def render_doctor(console: Console, result: DoctorReport) -> None:
    """The doctor's findings as lines and a table."""
    result = for_terminal(result)  # names from the system: no raw control characters or markup
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in result.versions.items()), highlight=False)
    console.print(f"system: {result.system}", highlight=False)
    flags = ", ".join(str(f) for f in result.cpu["flags"]) or "none detected"  # type: ignore[attr-defined]
    console.print(f"CPU: {result.cpu['model']} ({result.cpu['machine']}); flags: {flags}", highlight=False)
    if result.int8_kernels_saturate:
        console.print(
            "[yellow]note[/yellow] no VNNI: onnxruntime's uint8 x int8 kernels saturate on this CPU; qtool's default "
            "weight.saturation: auto fits the int8 weights that could saturate (see the README)"
        )
    table = Table(title="onnxruntime execution providers", title_justify="left")
    for column in ("provider", "loads", "detail"):
        table.add_column(column)
    for p in result.providers:
        table.add_row(p.name, "[green]yes[/green]" if p.loads else "[red]no[/red]", p.detail)
    console.print(table)
    opsets = ", ".join(f"{d} {o if o is not None else 'none'}" for d, o in result.qdq_kernel_opsets.items())
    console.print(f"newest opset with Q/DQ kernels: {opsets}", highlight=False)
    gpus = "; ".join(result.gpus) if result.gpus else "none found (no nvidia-smi)"
    console.print("GPUs: " + gpus, highlight=False)
