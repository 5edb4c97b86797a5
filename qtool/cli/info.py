"""``qtool observers``, ``qtool schema`` and ``qtool doctor``: what qtool and this machine offer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, fail, summary_console, write_json
from qtool.cli.options import JsonOption
from qtool.cli.run import run_command
from qtool.errors import ExitCode


@app.command()
def observers(json_out: JsonOption = None) -> None:
    """List the observers for --observer and calibration.observer: built-ins and installed plugins."""

    def action() -> None:
        from qtool.observers import describe_observers
        from qtool.reports.documents import to_json
        from qtool.reports.tables import render_observers

        rows = describe_observers()
        render_observers(summary_console(json_out), rows)
        if json_out:
            write_json(json_out, to_json({"schema_version": 1, "observers": rows}))

    run_command(action, {"--json": json_out})


@app.command()
def configs(json_out: JsonOption = None) -> None:
    """List the configs installed with qtool: give one by name, as in --config accurate."""

    def action() -> None:
        from qtool.config_files import packaged_configs
        from qtool.reports.documents import to_json
        from qtool.reports.terminal import printable

        rows = [{"name": name, "path": str(path), "about": _about(path)} for name, path in packaged_configs().items()]
        console = summary_console(json_out)
        for row in rows:
            console.print(f"[bold]{printable(row['name'])}[/bold]  {printable(row['about'])}", highlight=False)
        console.print("use one with --config NAME, or copy it from the path in --json and edit it", highlight=False)
        if json_out:
            write_json(json_out, to_json({"schema_version": 1, "configs": rows}))

    run_command(action, {"--json": json_out})


def _about(path: Path) -> str:
    """A config's first comment sentence: what it is for."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(part for part in lines if part)
    first = text.split(". ")[0].rstrip(".:") + "." if text else ""
    return first if len(first) <= 140 else first[: first.rfind(" ", 0, 140)] + " ..."


@app.command()
def schema(
    name: Annotated[
        str,
        typer.Argument(
            help="config, stats, or the report of calibrate, quantize, compare, inspect, tune or doctor (NAME-report).",
            show_default=False,
            metavar="NAME",
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="PATH", help="Write it here instead of stdout.")
    ] = None,
    json_out: Annotated[
        str | None,
        typer.Option("--json", metavar="PATH|-", help="The same as -o (the schema is JSON): PATH, or - for stdout."),
    ] = None,
) -> None:
    """Print the JSON Schema of a file qtool reads (config, stats) or a report it writes."""
    if output is not None and json_out is not None:
        fail("give -o or --json, not both (the schema is the command's only output)", ExitCode.BAD_INPUT)
    target = output if output is not None else (Path(json_out) if json_out not in (None, "-") else None)

    def action() -> None:
        from qtool.reports.documents import to_json
        from qtool.schemas import json_schema

        text = to_json(json_schema(name))
        if target is None:
            sys.stdout.write(text)
        else:
            from qtool.graph.model_io import write_text

            write_text(target, text)

    run_command(action, {"-o": target})


@app.command()
def doctor(json_out: JsonOption = None) -> None:
    """Check this machine: versions, execution providers (each loaded once), CPU features, GPUs."""

    def action() -> None:
        from qtool.pipeline.doctor import diagnose
        from qtool.reports.documents import doctor_to_dict, to_json
        from qtool.reports.tables import render_doctor

        result = diagnose()
        render_doctor(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(doctor_to_dict(result)))

    run_command(action, {"--json": json_out})
