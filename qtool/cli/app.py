"""The Typer app, its consoles and global options, progress bars, and the helpers every command shares."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text
from typer.core import TyperGroup

from qtool._version import __version__
from qtool.errors import ExitCode, QtoolError

GLOBAL_FLAGS = frozenset({"--debug", "--verbose", "-v", "--quiet", "-q", "--wide"})


class _GlobalFlagsAnywhere(TyperGroup):
    """The global flags work after the subcommand too: ``qtool quantize m.onnx -q`` as ``qtool -q quantize ...``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's own click Context
        end = args.index("--") if "--" in args else len(args)  # after "--" every word is an argument
        flags = [a for a in args[:end] if a in GLOBAL_FLAGS]
        rest = [a for a in args[:end] if a not in GLOBAL_FLAGS] + args[end:]
        return super().parse_args(ctx, flags + rest)


app = typer.Typer(
    cls=_GlobalFlagsAnywhere,
    name="qtool",
    help="Quantize ONNX models: calibrate activation ranges, rewrite to int8 QDQ, compare with the float model.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class StdoutClosed(Exception):
    """The reader of stdout went away (``qtool ... | head``) before the output was written."""


class _StdoutConsole(Console):
    """The stdout console: a closed pipe ends the command as :class:`StdoutClosed` (rich would exit 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise StdoutClosed


err_console = Console(stderr=True)
out_console = _StdoutConsole()
STATE = {"debug": False, "quiet": False}
SILENT = Console(quiet=True)  # where summaries go under --quiet
PIPE_WIDTH = 4096  # not a terminal: never wrap lines or cut table cells
T = TypeVar("T")


class _RateColumn(ProgressColumn):
    """Samples (or runs) per second."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.1f}/s" if speed else "-/s", style="progress.data.speed")


PLAIN_SECONDS = 10.0  # not a terminal: a progress line per task at most this often ($QTOOL_PROGRESS_SECONDS)


class _PlainTask:
    """One task's progress as plain lines: once it has run PLAIN_SECONDS, then as often, and when it ends."""

    def __init__(self, console: Console, description: str, total: int, interval: float) -> None:
        self.console, self.description, self.total, self.interval = console, description, total, interval
        self.done = 0
        self.started = self.last = time.monotonic()
        self.printed = False

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        finished = self.total > 0 and self.done >= self.total
        if now - self.last >= self.interval or (finished and self.printed):
            self._line(now, finished)

    def close(self) -> None:
        """A last line for a task that printed and ended short of its total (a search that stopped early)."""
        if self.printed and not (self.total > 0 and self.done >= self.total):
            self._line(time.monotonic(), True)

    def _line(self, now: float, finished: bool) -> None:
        counted = f"{self.done}/{self.total}" if self.done <= self.total else str(self.done)
        state = "done" if finished else "so far"
        self.console.print(
            f"progress: {self.description} {counted} {state} ({now - self.started:.0f} s)", highlight=False
        )
        self.last, self.printed = now, True
        if finished:
            self.total = self.done  # printed once


def _plain_interval() -> float:
    text = os.environ.get("QTOOL_PROGRESS_SECONDS", "")
    try:
        return max(0.0, float(text)) if text else PLAIN_SECONDS
    except ValueError:
        return PLAIN_SECONDS


@contextmanager
def progress_bars() -> Iterator[Callable[[str, int], Callable[[int], None]]]:
    """A progress factory: bars on a terminal, periodic plain lines in a log; the display starts with the first task."""
    if not STATE["quiet"] and not err_console.is_terminal:  # a log (CI): lines, no bars
        tasks: list[_PlainTask] = []

        def plain(description: str, total: int) -> Callable[[int], None]:
            tasks.append(_PlainTask(err_console, description, total, _plain_interval()))
            return tasks[-1].advance

        yield plain  # an error ends the run here: its message is the last line
        for task in tasks:
            task.close()
        return
    columns = (
        TextColumn("{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
    )
    progress = Progress(*columns, console=err_console, transient=False, disable=STATE["quiet"])

    def factory(description: str, total: int) -> Callable[[int], None]:
        if not progress.live.is_started:
            progress.start()
        task = progress.add_task(description, total=total)
        return lambda n: progress.advance(task, n)

    try:
        yield factory
    except BaseException:
        progress.live.transient = True  # a failed run leaves only its error message behind
        raise
    finally:
        if progress.live.is_started:
            progress.stop()


def fail(message: str, code: ExitCode) -> None:
    """Print one red ``error:`` line and exit with ``code``."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(int(code))


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``K/N`` -> (k, n), with 1 <= K <= N."""
    if text is None:
        return None
    k, sep, n = text.partition("/")
    ascii_digits = re.compile(r"[0-9]{1,9}")
    if (
        not sep
        or not ascii_digits.fullmatch(k.strip())
        or not ascii_digits.fullmatch(n.strip())
        or not 1 <= int(k) <= int(n)
    ):
        raise QtoolError(f"--shard expects K/N with 1 <= K <= N, got '{text}'")
    return int(k), int(n)


def parse_observer_options(pairs: list[str] | None) -> dict[str, Any]:
    """Parse KEY=VALUE pairs; values are read as YAML scalars (numbers, booleans, strings)."""
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise QtoolError(f"--observer-option expects KEY=VALUE, got '{pair}'")
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise QtoolError(f"--observer-option {pair}: the value is not a YAML scalar ({type(e).__name__})") from None
    return options


def write_json(target: str, text: str) -> None:
    """Write a JSON document to a file (atomically, with the other outputs) or, for ``-``, to stdout."""
    if target == "-":
        try:
            sys.stdout.write(text)
            sys.stdout.flush()  # a reader that closed the pipe (| head) shows here, inside the command
        except BrokenPipeError as e:
            raise StdoutClosed from e
    else:
        from qtool.graph.model_io import write_text

        write_text(target, text)


def _version(value: bool) -> None:
    if value:
        out_console.print(f"qtool {__version__}")
        raise typer.Exit()


class _Printable(logging.Filter):
    """Log lines with the control characters of names from the user's files escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        from qtool.reports.terminal import printable

        record.msg, record.args = printable(record.getMessage(), markup=False), None
        return True


def _log_handler() -> logging.Handler:
    """Rich's aligned lines on a terminal; plain ``LEVEL: message`` lines in a pipe (no padding)."""
    handler: logging.Handler
    if err_console.is_terminal:
        handler = RichHandler(console=err_console, show_time=False, show_path=False, markup=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    handler.addFilter(_Printable())
    return handler


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for user errors too.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each stage with its duration.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only errors and the outputs asked for (no tables, no bars).")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Never wrap lines or cut table cells (always so when output is piped).")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Quantize ONNX models."""
    if quiet and verbose:
        raise typer.BadParameter("--quiet and --verbose contradict each other", param_hint="--quiet")
    STATE["debug"] = debug
    STATE["quiet"] = quiet
    for console in (out_console, err_console):
        if wide or not console.is_terminal:
            console.width = PIPE_WIDTH
            console.soft_wrap = True
    logging.basicConfig(
        level=logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[_log_handler()],
        force=True,
    )


def summary_console(json_out: str | None) -> Console:
    """Where a command's human-readable summary goes: stderr when JSON takes stdout, nowhere when quiet."""
    if STATE["quiet"]:
        return SILENT
    return err_console if json_out == "-" else out_console
