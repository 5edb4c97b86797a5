"""The ``qtool`` command line: parse options, call :mod:`qtool.api`, render the result.

Each module holds a few commands; importing them registers them on :data:`app`.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.text import Text

from qtool.cli import calibrate, compare, info, quantize, tune  # noqa: F401 - registers the commands
from qtool.cli.app import app, err_console
from qtool.cli.help import GroupedCommand
from qtool.reports.terminal import printable

__all__ = ["app", "main"]

# --help lists the commands in the order of the pipeline, whatever order their modules load in
_ORDER = ("calibrate", "quantize", "tune", "compare", "inspect", "merge", "observers", "configs", "schema", "doctor")
app.registered_commands.sort(key=lambda c: _ORDER.index(c.callback.__name__) if c.callback else len(_ORDER))
for _command in app.registered_commands:  # --help in groups: inputs, outputs, then the knobs by topic
    _command.cls = GroupedCommand


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point: usage errors too become one ``error:`` line with exit 2."""
    try:
        code = app(args=argv, standalone_mode=False)
    except KeyboardInterrupt:  # while the command line was parsed: nothing ran, nothing was written
        err_console.print("interrupted (SIGINT): no output was written", highlight=False)
        sys.exit(130)
    except Exception as e:
        if type(e).__name__ == "Abort":  # click's form of Ctrl-C during parsing
            err_console.print("interrupted (SIGINT): no output was written", highlight=False)
            sys.exit(130)
        exit_code = getattr(e, "exit_code", None)
        if not (hasattr(e, "format_message") and isinstance(exit_code, int)):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `qtool`: the help, as --help prints it
            sys.stdout.write(e.format_message() + "\n")
            sys.exit(0)
        context = getattr(e, "ctx", None)
        where = f" (see '{context.command_path} --help')" if context is not None else ""
        err_console.print(
            Text.assemble(("error:", "bold red"), " ", printable(e.format_message(), markup=False) + where),
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(exit_code)
    sys.exit(code if isinstance(code, int) else 0)
