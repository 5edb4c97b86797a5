"""``qtool observers``, ``qtool schema`` and ``qtool doctor``: what qtool and this machine offer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, summary_console, write_json
from qtool.cli.options import JsonOption
from qtool.cli.run import run_command


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
def schema(
    name: Annotated[
        str,
        typer.Argument(
            help="config, stats, calibrate-report, quantize-report, compare-report, inspect-report or tune-report.",
            show_default=False,
            metavar="NAME",
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="PATH", help="Write it here instead of stdout.")
    ] = None,
) -> None:
    """Print the JSON Schema of a file qtool reads (config, stats) or a report it writes."""

    def action() -> None:
        from qtool.reports.documents import to_json
        from qtool.schemas import json_schema

        text = to_json(json_schema(name))
        if output is None:
            sys.stdout.write(text)
        else:
            from qtool.graph.model_io import write_text

            write_text(output, text)

    run_command(action, {"-o": output})


@app.command()
def doctor(json_out: JsonOption = None) -> None:
    """Check this machine: versions, execution providers (each loaded once), CPU features, GPUs."""

    def action() -> None:
        from qtool.reports.documents import doctor_to_dict, to_json
        from qtool.reports.tables import render_doctor
        from qtool.system.doctor import diagnose

        result = diagnose()
        render_doctor(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(doctor_to_dict(result)))

    run_command(action, {"--json": json_out})
