"""Rich tables of the placement choice and the sensitivity search (``quantize --data``)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from qtool.choice.records import TIE
from qtool.choice.search import SearchResult
from qtool.choice.selection import PlacementChoice
from qtool.options import DECODE_STEPS
from qtool.results import ComparisonResult
from qtool.schemas.reports.quantize import PlacementCandidate


def render_search(console: Console, f: SearchResult) -> None:
    """The sensitivity search: where it started, what it moved, what it reached."""
    if f.reached:
        verdict = "[green]reached[/green] (its lower confidence bound too)"
    elif f.final_sqnr_db >= f.target_sqnr_db and math.isfinite(f.final_bound_db):
        # over the target, but not by enough for the samples' spread: its lower bound is what falls short
        verdict = f"[yellow]not reached[/yellow] by its lower bound ({f.final_bound_db:.2f} dB; {f.stopped})"
    else:
        verdict = f"[yellow]not reached[/yellow] ({f.stopped})"
    ranked = f", nodes ranked by one per-layer pass on {f.ranked_on_samples}" if f.ranked_on_samples else ""
    ranked += f" ({f.ranked_by})" if f.ranked_on_samples and f.ranked_by != "drop" else ""  # the cheap moves first
    console.print(
        f"sensitivity search from '{f.start}' ({f.moves} for the nodes that cost most) on {f.samples} samples"
        f"{ranked}: worst output {f.initial_sqnr_db:.2f} -> "
        f"{f.final_sqnr_db:.2f} dB, target {f.target_sqnr_db:g} dB {verdict}",
        highlight=False,
    )
    for step in f.steps:
        outcome = f.moves if step.kept else "no gain, kept quantized"
        cost = f", ~{step.cost_ms:.2f} ms" if step.cost_ms is not None else ""
        drop = f"drop {step.drop_db:.1f} dB" if step.drop_db is not None else "in a body, not measured"
        what = f"{step.op_type}, {drop}{cost}"
        console.print(
            f"  {step.node} ({what}): {outcome}, output {step.sqnr_db:.2f} dB",
            highlight=False,
        )


def _decode_cell(agreement: float | None, bar: float | None) -> str:
    if agreement is None:
        return ""
    return f"[{'green' if bar is None or agreement >= bar else 'yellow'}]{agreement:.1%}[/]"


def render_choice(console: Console, c: PlacementChoice, comparison: ComparisonResult | None) -> None:
    """The placement choice: each candidate scored, decoded and timed, the one kept and its validation."""
    console.print(_candidates_table(c))
    _choice_notes(console, c, comparison)


def _candidates_table(c: PlacementChoice) -> Table:
    """One row per candidate (and fp32): its nodes, worst output, decode agreement and latency."""
    listed = ", ".join(c.samples[:4]) + (f", ... ({len(c.samples)} in all)" if len(c.samples) > 4 else "")
    listed += ", each as a prefill and as the decode step after it" if c.decode_steps else ""
    table = Table(
        title=f"placement chosen by measurement: [bold]{c.chosen}[/bold], {c.reason}",
        title_justify="left",
        caption=f"worst output SQNR on the scored samples ({listed}); latency: median, {c.threads} thread"
        + ("s" if c.threads != 1 else "")
        + (f"; {c.timing_note}" if c.timing_note else ""),
        caption_justify="left",
    )
    decodes = c.decode_bar is not None
    chains = any(k.chained_nodes for k in c.candidates)
    columns = [
        "placement",
        "integer nodes",
        *(["chained ops"] if chains else []),
        "storage nodes",
        "worst output dB",
        *(["decode"] if decodes else []),
    ]
    for column in [*columns, "median ms", "vs fp32"]:
        table.add_column(column, justify="left" if column == "placement" else "right")
    if c.fp32_ms is not None:
        table.add_row("fp32", *[""] * (len(columns) - 1), f"{c.fp32_ms:.3f}", "1.00x")
    for k in c.candidates:
        name = k.name + _same_as(k, c)
        if k.name == c.chosen:
            name = f"[bold green]> {name}[/bold green]"
        speedup = c.speedup(k)
        table.add_row(
            name,
            str(k.integer_nodes),
            *([str(k.chained_nodes)] if chains else []),
            str(k.storage_nodes),
            f"[{'green' if k.meets_target else 'yellow'}]{k.sqnr_db:.2f}[/]",
            *([_decode_cell(k.decode_agreement, c.decode_bar)] if decodes else []),
            "" if k.latency_ms is None else f"{k.latency_ms:.3f}",
            "" if speedup is None else f"{speedup:.2f}x",
        )
    return table


def _choice_notes(console: Console, c: PlacementChoice, comparison: ComparisonResult | None) -> None:
    """The lines under the table: the range rule, decoding, validation, why no speed-up, the scored samples."""
    if len(c.range_worst_db) == 2:
        clipped, unclipped = c.range_worst_db["observer"], c.range_worst_db["extremes"]
        kept = "the observed min/max" if c.activation_ranges == "extremes" else "the observer's (clipped) ranges"
        console.print(
            f"activation ranges: {kept}, as the all-integer placement scored {clipped:.2f} dB with the observer's "
            f"ranges and {unclipped:.2f} dB with the observed min/max",
            highlight=False,
        )
    if c.judged_note:
        console.print(f"judged: {c.judged_note}", highlight=False)
    if c.rounding_note:
        console.print(f"weights: {c.rounding_note}", highlight=False)
    if c.decode_bar is not None:
        console.print(
            f"decode: agreement with fp32 over {DECODE_STEPS} greedy steps per sample through each placement's own "
            f"cache; a placement below dynamic int8's ({c.decode_bar:.1%}) is not kept",
            highlight=False,
        )
    for index, r in enumerate(c.validations):
        v = r.validation
        verdict = "reaches" if v.meets else "[yellow]misses[/yellow]"
        again = any(earlier.choice == r.choice for earlier in c.validations[:index])  # rounded by GPTQ since
        name = f"'{r.choice}' with GPTQ-rounded weights" if again else f"'{r.choice}'"
        console.print(
            f"validated: {name} {v.sqnr_db:.2f} dB ({c.confidence:.0%} bound {v.bound_db:.2f} dB) on "
            f"{len(v.samples)} samples the choice never scored"
            + (", also closed-loop over their sequences (the worse kept)" if v.closed_loop else "")
            + f": {verdict} {c.target_sqnr_db:g} dB",
            highlight=False,
        )
    if c.search_note:
        console.print(f"[yellow]note[/yellow] {c.search_note}", highlight=False)
    if not c.expects_speedup:
        console.print(f"[yellow]note[/yellow] {_no_speedup_note(c)}", highlight=False)
    if comparison is not None and comparison.outputs:
        # the outputs the target judged: pooled when not every output is (the state fed back is reported apart)
        judged = comparison.judged.sqnr_db if comparison.judged is not None else None
        below = (
            f"{judged:.2f} dB pooled" if judged is not None else f"{min(m.sqnr_db for m in comparison.outputs):.2f} dB"
        )
        console.print(
            f"{'judged outputs' if judged is not None else 'worst output'}: {c.chosen_candidate.sqnr_db:.2f} dB on "
            f"the {len(c.samples)} scored samples, {below} on the {comparison.samples} samples compared below",
            highlight=False,
        )


def _no_speedup_note(c: PlacementChoice) -> str:
    """Why the kept placement runs at fp32 speed, from the same figures as the table above it."""
    missed = {r.choice for r in c.validations if not r.validation.meets}
    faster = [(k, c.speedup(k) or 0.0) for k in c.candidates if k.name != c.chosen and (c.speedup(k) or 0.0) > 1 + TIE]
    if faster:
        why = "the faster placements miss the target: " + ", ".join(
            f"{k.name} {ratio:.2f}x ({'on the validation samples' if k.name in missed else 'on the scored samples'})"
            for k, ratio in faster
        )
    elif c.fp32_ms is None or all(k.latency_ms is None for k in c.candidates):
        why = "nothing was timed" + (f" ({c.timing_note})" if c.timing_note else "")
    else:
        why = f"no placement measured more than {TIE:.0%} faster than fp32 here"
    chosen = c.chosen_candidate
    if chosen.storage_nodes:
        kept = "its weights are stored quantized"
    elif chosen.integer_nodes:
        kept = "its integer nodes run at about fp32 speed"
    else:
        kept = "no node runs an integer kernel"  # weight-only nodes (fp16, 4-bit) compute in float
    return f"{why}: the model runs at fp32 speed (no speed-up expected); {kept}"


def _same_as(k: PlacementCandidate, c: PlacementChoice) -> str:
    """The other candidates that planned exactly ``k``'s placement, in words true to the nodes."""
    if not k.same_as:
        return ""
    if len(c.candidates) == 1:  # the others were the same model, merged into it
        return " (every placement plans this same model: no node's placement is left to choose)"
    return f" (the same placement as {', '.join(k.same_as)})"
