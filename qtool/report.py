"""Rich tables and JSON documents built from the same result records."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from qtool import __version__
from qtool.api import ComparisonResult, QuantizeResult
from qtool.calibration import CalibrationStats
from qtool.comparison import ErrorMetrics, LatencyStats
from qtool.doctor import Doctor
from qtool.inspection import Inspection
from qtool.layers import LayerError, largest_drop
from qtool.schemas.reports import CalibrateReport, CompareReport, QuantizeReport
from qtool.sensitivity import FallbackResult
from qtool.terminal import for_terminal

SCHEMA_VERSION = 1  # inspect / quantize / calibrate documents
COMPARE_SCHEMA_VERSION = 2  # 2: latency per provider, gates, per-layer, classification, reproducibility


def _finite(value: float) -> float | None:
    """JSON has no infinity: an exact match (infinite SQNR) is written as null."""
    return value if math.isfinite(value) else None


def _metrics_dict(m: ErrorMetrics) -> dict[str, Any]:
    return {
        "name": m.name,
        "mse": m.mse,
        "sqnr_db": _finite(m.sqnr_db),
        "cosine": m.cosine,
        "max_abs_error": m.max_abs_error,
        "elements": m.elements,
    }


def _latency_dict(stats: LatencyStats) -> dict[str, Any]:
    return {
        "median_ms": stats.median_ms,
        "p90_ms": stats.p90_ms,
        "p99_ms": stats.p99_ms,
        "mean_ms": stats.mean_ms,
        "runs": stats.runs,
    }


def comparison_to_dict(result: ComparisonResult) -> dict[str, Any]:
    """The ``qtool compare --json`` document (schema: :class:`qtool.schemas.reports.CompareReport`)."""
    drop = largest_drop(result.layers or [])
    return _conforming(
        CompareReport,
        {
            "schema_version": COMPARE_SCHEMA_VERSION,
            "qtool_version": __version__,
            "models": {
                "reference": {"path": result.reference.path, "sha256": result.reference.sha256},
                "candidate": {"path": result.candidate.path, "sha256": result.candidate.sha256},
            },
            "data": {"dir": result.data_dir, "samples": result.samples},
            "size": {
                "reference_bytes": result.reference.size_bytes,
                "candidate_bytes": result.candidate.size_bytes,
                "compression_ratio": result.compression_ratio,
            },
            "accuracy": {
                "overall": _metrics_dict(result.overall),
                "outputs": [_metrics_dict(m) for m in result.outputs],
                "task": result.task_note,
                "classification": [
                    {"output": a.name, "top1": a.top1, "top5": a.top5, "rows": a.rows} for a in result.agreement
                ],
            },
            "per_layer": None
            if result.layers is None
            else {
                "largest_drop": None
                if drop is None
                else {"node": drop.node, "tensor": drop.tensor, "drop_db": drop.drop_db},
                "layers": [
                    {
                        "tensor": r.tensor,
                        "node": r.node,
                        "op_type": r.op_type,
                        "sqnr_db": _finite(r.sqnr_db),
                        "mse": r.mse,
                        "cosine": r.cosine,
                        "input_sqnr_db": r.input_sqnr_db,
                        "drop_db": r.drop_db,
                    }
                    for r in result.layers
                ],
            },
            "latency": [
                {
                    "provider": lat.provider,
                    "threads": lat.threads,
                    "reference": _latency_dict(lat.reference),
                    "candidate": _latency_dict(lat.candidate),
                    "speedup": lat.speedup,
                }
                for lat in result.latency
            ],
            "skipped_providers": [{"provider": p, "reason": why} for p, why in result.skipped_providers],
            "gates": {
                "passed": result.gates_passed,
                "results": [
                    {
                        "gate": g.gate.label,
                        "metric": g.gate.metric,
                        "direction": g.gate.direction,
                        "threshold": g.gate.threshold,
                        "measured": None if g.measured is None else _finite(g.measured),
                        "passed": g.passed,
                        "note": g.note,
                    }
                    for g in result.gates
                ],
            },
            "reproducibility": {
                "reference_sha256": result.reference.sha256,
                "candidate_sha256": result.candidate.sha256,
                **result.reproducibility,
            },
        },
    )


def quantize_to_dict(result: QuantizeResult) -> dict[str, Any]:
    """The ``qtool quantize --json`` document (schema: :class:`qtool.schemas.reports.QuantizeReport`)."""
    return _conforming(
        QuantizeReport,
        {
            "schema_version": SCHEMA_VERSION,
            "qtool_version": __version__,
            "input": {"path": result.source.path, "bytes": result.source.size_bytes, "sha256": result.source.sha256},
            "output": {
                "path": result.output.path,
                "bytes": result.output.size_bytes,  # the model file and its external data files
                "sha256": result.output.sha256,
                "data_files": result.data_files,
            },
            "compression_ratio": result.compression_ratio,
            "calibration_samples": result.calibration_samples,
            "quantized": {
                "nodes": result.rewrite.quantized_nodes,
                "weights": result.rewrite.quantized_weights,
                "biases": result.rewrite.quantized_biases,
                "activations": result.rewrite.quantized_activations,
            },
            "skipped": [{"node": node, "reason": reason} for node, reason in result.skipped],
            "passthrough_ops": result.rewrite.passthrough,
            "placements": result.placements,
            "predicted_kernels": result.kernels,
            "prepare": {
                "constants_to_initializers": result.prepare.constants_to_initializers,
                "folded_batchnorms": result.prepare.folded_batchnorms,
                "opset_before": result.prepare.opset_before,
                "opset_after": result.prepare.opset_after,
                "shape_inference_error": result.prepare.shape_inference_error,
            },
            "sensitivity": _fallback_dict(result.fallback) if result.fallback else None,
            "notes": result.notes,
            "comparison": comparison_to_dict(result.comparison) if result.comparison else None,
        },
    )


def _fallback_dict(f: FallbackResult) -> dict[str, Any]:
    return {
        "target_sqnr_db": f.target_sqnr_db,
        "max_float_nodes": f.max_nodes,
        "samples": f.samples,
        "initial_sqnr_db": _finite(f.initial_sqnr_db),
        "final_sqnr_db": _finite(f.final_sqnr_db),
        "reached": f.reached,
        "float_activation_nodes": f.float_nodes,
        "steps": [
            {"node": s.node, "op_type": s.op_type, "drop_db": s.drop_db, "sqnr_db": _finite(s.sqnr_db), "kept": s.kept}
            for s in f.steps
        ],
    }


def stats_summary_dict(stats: CalibrationStats, path: str) -> dict[str, Any]:
    """The ``qtool calibrate --json`` summary (schema: :class:`qtool.schemas.reports.CalibrateReport`)."""
    return _conforming(
        CalibrateReport,
        {
            "schema_version": SCHEMA_VERSION,
            "qtool_version": __version__,
            "stats_path": path,
            "observer": stats.observer,
            "samples": stats.samples,
            "tensors": len(stats.tensors),
            "model_sha256": stats.model_sha256,
        },
    )


def _conforming(model: type[BaseModel], document: dict[str, Any]) -> dict[str, Any]:
    """``document`` after its schema model has checked it: a report never drifts from its schema."""
    model.model_validate(document)
    return document


def to_json(document: dict[str, Any]) -> str:
    """Stable, pretty JSON text."""
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


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


def render_comparison(console: Console, result: ComparisonResult, title: str = "qtool compare") -> None:
    """Print size, accuracy, per-layer, latency and gate tables."""
    result = for_terminal(result)  # names from the user's files: no raw control characters or markup
    size = Table(title=title, title_justify="left", show_header=True)
    size.add_column("")
    size.add_column("reference", justify="right")
    size.add_column("candidate", justify="right")
    size.add_row("file", result.reference.path, result.candidate.path)
    size.add_row("size", _bytes(result.reference.size_bytes), _bytes(result.candidate.size_bytes))
    size.add_row("compression", "", f"[bold]{result.compression_ratio:.2f}x[/bold]")
    console.print(size)

    acc = Table(title=f"accuracy vs reference, {result.samples} samples", title_justify="left")
    for column in ("output", "SQNR dB", "cosine", "MSE", "max |err|"):
        acc.add_column(column, justify="left" if column == "output" else "right")
    for m in [*result.outputs, result.overall] if len(result.outputs) > 1 else result.outputs:
        acc.add_row(m.name, _db(m.sqnr_db), f"{m.cosine:.6f}", f"{m.mse:.3e}", f"{m.max_abs_error:.3e}")
    console.print(acc)
    console.print(f"task: {result.task_note}", highlight=False)
    for a in result.agreement:
        console.print(f"  {a.name}: top-1 agreement {a.top1:.2%}, top-5 {a.top5:.2%} over {a.rows} rows")

    if result.layers is not None:
        render_layers(console, result.layers)

    for lat in result.latency:
        threads = lat.threads if lat.threads else "default"
        provider = lat.provider.removesuffix("ExecutionProvider")
        table = Table(title=f"latency, {provider}, threads={threads}, {lat.reference.runs} runs", title_justify="left")
        for column in ("model", "median ms", "p90 ms", "p99 ms"):
            table.add_column(column, justify="left" if column == "model" else "right")
        for label, stats in (("reference", lat.reference), ("candidate", lat.candidate)):
            table.add_row(label, f"{stats.median_ms:.3f}", f"{stats.p90_ms:.3f}", f"{stats.p99_ms:.3f}")
        colour = "green" if lat.speedup >= 1 else "yellow"
        table.add_row("speed-up", f"[{colour}]{lat.speedup:.2f}x[/{colour}]", "", "")
        console.print(table)
    for provider, reason in result.skipped_providers:
        console.print(f"[yellow]latency on {provider} skipped[/yellow]: {reason}", highlight=False)

    if result.gates:
        gates = Table(title="gates", title_justify="left")
        for column in ("gate", "measured", "verdict"):
            gates.add_column(column)
        for g in result.gates:
            gates.add_row(g.gate.label, _value(g.measured) + (f" ({g.note})" if g.note else ""), _verdict(g.passed))
        console.print(gates)


def render_layers(console: Console, layers: list[LayerError], show: int = 15) -> None:
    """Per-layer SQNR, worst first, and the layer that introduces the largest drop."""
    layers = for_terminal(layers)  # names from the user's files: no raw control characters or markup
    table = Table(
        title=f"per-layer error, worst {min(show, len(layers))} of {len(layers)} tensors", title_justify="left"
    )
    for column in ("tensor", "node", "op", "SQNR dB", "drop dB", "MSE"):
        table.add_column(column, justify="right" if column in ("SQNR dB", "drop dB", "MSE") else "left")
    for r in layers[:show]:
        table.add_row(r.tensor, r.node, r.op_type, _db(r.sqnr_db), f"{r.drop_db:.2f}", f"{r.mse:.3e}")
    console.print(table)
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


def inspection_to_dict(result: Inspection) -> dict[str, Any]:
    """The ``qtool inspect --json`` document."""
    return {
        "schema_version": SCHEMA_VERSION,
        "qtool_version": __version__,
        "model": {"path": result.model_path, "bytes": result.model_bytes},
        "nodes": [
            {
                "name": r.name,
                "op_type": r.op_type,
                "rule": r.rule,
                "weight": r.weight,
                "activation": r.activation,
                "weight_elements": r.weight_elements,
                "float_bytes": r.float_bytes,
                "quantized_bytes": r.quantized_bytes,
                "placement": r.placement,
                "placement_reason": r.reason,
                "predicted_kernel": r.kernel,
                "integer_kernel": not r.kernel.startswith("float"),
                "kernel_reason": r.kernel_reason,
            }
            for r in result.rows
        ],
        "kept_float": [{"node": n, "op_type": op, "reason": why} for n, op, why in result.kept_float],
        "passthrough_ops": result.passthrough,
        "totals": {
            "weight_elements": sum(r.weight_elements for r in result.rows),
            "float_bytes": sum(r.float_bytes for r in result.rows),
            "quantized_bytes": sum(r.quantized_bytes for r in result.rows),
            "predicted_model_bytes": result.predicted_bytes,
            "predicted_compression_ratio": result.predicted_ratio,
        },
    }


def render_inspection(console: Console, result: Inspection) -> None:
    """Print the per-node plan, what stays float, and the predicted compression."""
    result = for_terminal(result)  # names from the user's files: no raw control characters or markup
    table = Table(title=f"qtool inspect {result.model_path}", title_justify="left")
    for column in ("node", "op", "rule", "weight", "activation", "runs as", "elements", "float B", "quantized B"):
        table.add_column(column, justify="right" if column in ("elements", "float B", "quantized B") else "left")
    for r in result.rows:
        table.add_row(
            r.name,
            r.op_type,
            r.rule,
            r.weight,
            r.activation,
            r.placement,
            f"{r.weight_elements:,}",
            f"{r.float_bytes:,}",
            f"{r.quantized_bytes:,}",
        )
    table.add_section()
    total = [
        f"{sum(getattr(r, k) for r in result.rows):,}" for k in ("weight_elements", "float_bytes", "quantized_bytes")
    ]
    table.add_row("total", "", "", "", "", "", *total)
    console.print(table)
    console.print(
        f"model {_bytes(result.model_bytes)} -> predicted {_bytes(result.predicted_bytes)}, "
        f"compression [bold]{result.predicted_ratio:.2f}x[/bold]"
    )
    reasons = [r for r in result.rows if r.reason]
    if reasons:
        placement = Table(title="placement and the kernel onnxruntime (CPU) is predicted to run", title_justify="left")
        for column in ("node", "runs as", "why", "predicted kernel", "because"):
            placement.add_column(column)
        for r in reasons:
            colour = "red" if r.kernel.startswith("float") and r.placement == "integer" else "green"
            placement.add_row(r.name, r.placement, r.reason, f"[{colour}]{r.kernel}[/{colour}]", r.kernel_reason)
        console.print(placement)
    if result.kept_float:
        kept = Table(title="kept in float", title_justify="left")
        for column in ("node", "op", "why"):
            kept.add_column(column)
        for name, op, why in result.kept_float:
            kept.add_row(name, op, why)
        console.print(kept)
    if result.passthrough:
        listed = ", ".join(f"{op} x{count}" for op, count in result.passthrough.items())
        console.print(f"passed through untouched (not quantized by qtool): {listed}")


def _render_fallback(console: Console, f: FallbackResult) -> None:
    verdict = "[green]reached[/green]" if f.reached else "[yellow]not reached[/yellow]"
    console.print(
        f"sensitivity search on {f.samples} samples: worst output {f.initial_sqnr_db:.2f} -> "
        f"{f.final_sqnr_db:.2f} dB, target {f.target_sqnr_db:g} dB {verdict}",
        highlight=False,
    )
    for step in f.steps:
        outcome = "float activations" if step.kept else "no gain, kept integer"
        console.print(
            f"  {step.node} ({step.op_type}, drop {step.drop_db:.1f} dB): {outcome}, output {step.sqnr_db:.2f} dB",
            highlight=False,
        )


def render_quantize(console: Console, result: QuantizeResult) -> None:
    """Print what quantize did, then the comparison when there is one."""
    result = for_terminal(result)  # names from the user's files: no raw control characters or markup
    r = result.rewrite
    console.print(
        f"[green]wrote[/green] {result.output.path}: {len(r.quantized_nodes)} nodes quantized "
        f"({len(r.quantized_weights)} weights, {len(r.quantized_biases)} biases, "
        f"{len(r.quantized_activations)} activations), "
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
    p = result.prepare
    done = []
    if p.folded_batchnorms:
        done.append(f"folded {len(p.folded_batchnorms)} BatchNormalization")
    if p.constants_to_initializers:
        done.append(f"{p.constants_to_initializers} Constant nodes -> initializers")
    if p.opset_after != p.opset_before:
        done.append(f"opset {p.opset_before} -> {p.opset_after}")
    if done:
        console.print("prepared: " + "; ".join(done))
    for node, reason in result.skipped:
        console.print(f"[yellow]kept in float[/yellow] {node}: {reason}")
    if r.passthrough:
        listed = ", ".join(f"{op} x{count}" for op, count in r.passthrough.items())
        console.print(f"passed through untouched (not quantized by qtool): {listed}", highlight=False)
    if result.fallback is not None:
        _render_fallback(console, result.fallback)
    for note in result.notes:
        console.print(f"[yellow]note[/yellow] {note}")
    if result.comparison is not None:
        render_comparison(console, result.comparison, title="float vs quantized")


def doctor_to_dict(result: Doctor) -> dict[str, Any]:
    """``qtool doctor --json``."""
    return {
        "schema_version": 1,
        "versions": result.versions,
        "system": result.system,
        "cpu": result.cpu,
        "int8_kernels_saturate": result.int8_saturates,
        "providers": [{"name": p.name, "loads": p.loads, "detail": p.detail} for p in result.providers],
        "qdq_kernel_opsets": result.qdq_opsets,
        "gpus": result.gpus,
    }


def render_doctor(console: Console, result: Doctor) -> None:
    """The doctor's findings as lines and a table."""
    result = for_terminal(result)  # names from the system: no raw control characters or markup
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in result.versions.items()), highlight=False)
    console.print(f"system: {result.system}", highlight=False)
    flags = ", ".join(str(f) for f in result.cpu["flags"]) or "none detected"  # type: ignore[attr-defined]
    console.print(f"CPU: {result.cpu['model']} ({result.cpu['machine']}); flags: {flags}", highlight=False)
    if result.int8_saturates:
        console.print(
            "[yellow]note[/yellow] no VNNI: onnxruntime's uint8 x int8 kernels saturate on this CPU; qtool's default "
            "weight.saturation: uint8 keeps its integer kernels exact (see the README)"
        )
    table = Table(title="onnxruntime execution providers", title_justify="left")
    for column in ("provider", "loads", "detail"):
        table.add_column(column)
    for p in result.providers:
        table.add_row(p.name, "[green]yes[/green]" if p.loads else "[red]no[/red]", p.detail)
    console.print(table)
    opsets = ", ".join(f"{d} {o if o is not None else 'none'}" for d, o in result.qdq_opsets.items())
    console.print(f"newest opset with Q/DQ kernels: {opsets}", highlight=False)
    console.print("GPUs: " + ("; ".join(result.gpus) if result.gpus else "none found (no nvidia-smi)"), highlight=False)
