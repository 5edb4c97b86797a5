"""Reports for CI systems: Markdown summaries and JUnit XML gates."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from qtool.evaluation.language_model import language_model_lines
from qtool.evaluation.layers import largest_drop, layer_drop, layer_op
from qtool.reports.terminal import printable
from qtool.results import ComparisonResult
from qtool.schemas.reports.compare import Baseline, BaselineChange, Layer


def _md(text: object) -> str:
    """A name or path for a Markdown table cell or code span: control characters escaped, ``|`` and backticks too.

    A tensor named with a line break or a ``|`` must not end the table or add rows of its own.
    """
    return printable(str(text), markup=False).replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")


def _xml(text: object) -> str:
    """A value for XML: control characters (which XML 1.0 cannot hold) escaped as visible text."""
    return printable(str(text), markup=False)


def _num(value: float | None, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


CALIBRATION_WARNING = (
    "> **Scored on the calibration samples**: not held-out data; the accuracy here is optimistic "
    "(give `quantize --eval DIR`, or `compare` other samples)."
)


def _change(value: float | None, metric: str) -> str:
    if value is None:
        return ""
    return f"{value:+.2f} dB" if metric == "sqnr" else f"{value:+.3f}"


def baseline_markdown(baseline: Baseline) -> list[str]:
    """The "against the baseline" section of the Markdown report."""
    verdict = "**regressed**" if baseline.regressed else "no regression"
    lines = ["", f"### Against the baseline (`{_md(baseline.path)}`): {verdict}", ""]
    if not baseline.same_reference:
        lines += ["> The baseline measured another reference model.", ""]
    if not baseline.same_data:
        lines += ["> The baseline was measured on other data (name or sample count).", ""]
    lines += ["| metric | baseline | now | change | |", "|---|---:|---:|---:|---|"]
    for c in baseline.changes:
        mark = "regressed" if c.regressed else ("better" if improved(c) else "")
        note = "; ".join(part for part in (mark, c.note) if part)
        lines.append(
            f"| {_md(c.metric)} | {_num(c.baseline, '.3f')} | {_num(c.current, '.3f')} | "
            f"{_change(c.change, c.metric)} | {_md(note)} |"
        )
    return lines


def improved(c: BaselineChange) -> bool:
    """Whether the number moved the better way."""
    if c.change is None or c.change == 0:
        return False
    return (c.change > 0) == (c.better == "higher")


def to_markdown(result: ComparisonResult) -> str:
    """A Markdown report (for ``$GITHUB_STEP_SUMMARY`` and pull-request comments)."""
    lines = [
        *_md_summary(result),
        *_md_accuracy(result),
        *(_md_layers(result.layers) if result.layers is not None else []),
        *_md_latency(result),
        *(baseline_markdown(result.baseline) if result.baseline is not None else []),
        *_md_gates(result),
    ]
    return "\n".join(lines) + "\n"


def _md_summary(result: ComparisonResult) -> list[str]:
    """The title, the gates' verdict and the two files' sizes."""
    lines = [f"## qtool compare: {_md(result.candidate.path)}", ""]
    if result.gates:
        verdict = "passed" if result.gates_passed else "FAILED"
        failed = sum(not g.passed for g in result.gates)
        counts = f"{failed} of {len(result.gates)} failed" if failed else f"all {len(result.gates)} passed"
        lines += [f"**Gates {verdict}** ({counts})", ""]
    return [
        *lines,
        "| | reference | candidate |",
        "|---|---:|---:|",
        f"| file | `{_md(result.reference.path)}` | `{_md(result.candidate.path)}` |",
        f"| bytes | {result.reference.size_bytes:,} | {result.candidate.size_bytes:,} |",
        f"| compression | | **{result.compression_ratio:.2f}x** |",
    ]


def _md_accuracy(result: ComparisonResult) -> list[str]:
    """Each output's error, and the task's own figures (agreement, box IoU)."""
    lines = [
        "",
        f"### Accuracy ({result.samples} samples of `{_md(result.data_dir)}`)",
        "",
        *([CALIBRATION_WARNING, ""] if result.calibration_data else []),
        "| output | SQNR dB | cosine | MSE | max abs error |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = [*result.outputs, result.overall] if len(result.outputs) > 1 else result.outputs
    for m in rows:
        figures = f"{_num(m.sqnr_db, '.2f')} | {m.cosine:.6f} | {m.mse:.3e} | {m.max_abs_error:.3e}"
        lines.append(f"| {_md(m.name)} | {figures} |")
    lines += ["", f"Task: {_md(result.task)}."]
    for a in result.classification:
        lines.append(f"- `{_md(a.output)}`: top-1 agreement {a.top1:.2%}, top-5 {a.top5:.2%} ({a.rows} rows)")
    for b in result.boxes:
        lines.append(f"- `{_md(b.output)}`: mean box IoU {b.mean_iou:.4f} ({b.boxes} boxes)")
    if result.language_model is not None:
        lines += ["", f"Language model (`{_md(result.language_model.logits)}`):"]
        lines += [f"- {line}" for line in language_model_lines(result.language_model)]
    return lines


def _md_layers(layers: list[Layer]) -> list[str]:
    """The ten worst layers, the largest drop and the pairings that could not be trusted."""
    lines = [
        "",
        "### Per-layer error (worst 10)",
        "",
        "| tensor | node | op | SQNR dB | drop dB |",
        "|---|---|---|---:|---:|",
    ]
    for r in layers[:10]:
        names = f"{_md(r.tensor)} | {_md(r.node)} | {_md(layer_op(r))}"
        lines.append(f"| {names} | {_num(r.sqnr_db, '.2f')} | {layer_drop(r)} |")
    drop = largest_drop(layers)
    if drop is not None:
        lines += ["", f"Largest drop: **{_md(drop.node)}** ({_md(drop.op_type)}), {drop.drop_db:.1f} dB."]
    uncertain = [r for r in layers if r.uncertain]
    if uncertain:
        example = f"{_md(uncertain[0].tensor)}: {_md(uncertain[0].uncertain)}"
        lines += ["", f"Uncertain pairings (no drop given): {len(uncertain)}, e.g. {example}."]
    return lines


def _md_latency(result: ComparisonResult) -> list[str]:
    """One row per execution provider measured (or skipped, and why)."""
    if not result.latency and not result.skipped_providers:
        return []
    lines = [
        "",
        "### Latency",
        "",
        "| provider | threads | reference median ms | candidate median ms | "
        "p90 ms (ref / cand) | p99 ms (ref / cand) | speed-up (99 % interval) | setup ms (ref / cand) | "
        "candidate dB there |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lat in result.latency:
        setup = f"{lat.setup_ms[0]:.0f} / {lat.setup_ms[1]:.0f}" if lat.setup_ms else ""
        there = f"{lat.candidate_sqnr_db:.2f}" if lat.candidate_sqnr_db is not None else ""
        interval = lat.speedup_interval
        speedup = f"{lat.speedup:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")
        lines.append(
            f"| {lat.provider} | {lat.threads or 'default'} | {lat.reference.median_ms:.3f} | "
            f"{lat.candidate.median_ms:.3f} | {lat.reference.p90_ms:.3f} / {lat.candidate.p90_ms:.3f} | "
            f"{lat.reference.p99_ms:.3f} / {lat.candidate.p99_ms:.3f} | {speedup} | {setup} | {there} |"
        )
    for provider, reason in result.skipped_providers:
        lines.append(f"| {provider} | | skipped: {_md(reason)} | | | | | | |")
    return lines


def _md_gates(result: ComparisonResult) -> list[str]:
    """Each gate, what was measured and its verdict."""
    if not result.gates:
        return []
    lines = ["", "### Gates", "", "| gate | measured | verdict |", "|---|---:|---|"]
    for g in result.gates:
        mark = "pass" if g.passed else "**FAIL**"
        note = f" ({_md(g.note)})" if g.note else ""
        lines.append(f"| `{_md(g.gate)}` | {_num(g.measured)}{note} | {mark} |")
    return lines


def to_junit(result: ComparisonResult) -> str:
    """The gates as a JUnit XML test suite: one test case per gate, a failed gate as a failure."""
    failures = sum(not g.passed for g in result.gates)
    suites = ET.Element("testsuites", name="qtool", tests=str(len(result.gates)), failures=str(failures))
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="qtool compare",
        tests=str(len(result.gates)),
        failures=str(failures),
        errors="0",
        skipped="0",
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("reference", _xml(result.reference.path)),
        ("candidate", _xml(result.candidate.path)),
        ("compression_ratio", f"{result.compression_ratio:.4f}"),
    ):
        ET.SubElement(props, "property", name=name, value=value)
    for g in result.gates:
        label = _xml(g.gate)
        case = ET.SubElement(suite, "testcase", classname=f"qtool.evaluation.gates.{_xml(g.metric)}", name=label)
        measured = _num(g.measured)
        if not g.passed:
            failure = ET.SubElement(
                case, "failure", message=f"measured {measured}, required {label}", type="GateFailed"
            )
            failure.text = _xml(f"{g.metric} = {measured} ({g.note or 'threshold missed'}); gate {label}")
        else:
            ET.SubElement(case, "system-out").text = _xml(f"{g.metric} = {measured}")
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
