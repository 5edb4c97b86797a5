"""The ``qtool`` command line: parse options, call :mod:`qtool.api`, render the result.

Each module holds a few commands; importing them registers them on :data:`app`.
"""

from __future__ import annotations

from typing import Any

from qtool.cli import calibrate, compare, info, quantize  # noqa: F401 - registers the commands
from qtool.cli.app import app

__all__ = ["app", "main"]

# --help lists the commands in the order of the pipeline, whatever order their modules load in
_ORDER = ("calibrate", "quantize", "compare", "inspect", "merge", "observers", "schema", "doctor")
app.registered_commands.sort(key=lambda c: _ORDER.index(c.callback.__name__) if c.callback else len(_ORDER))


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    return app(args=argv)
