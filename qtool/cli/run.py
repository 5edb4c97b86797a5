"""Running one command: outputs checked first and kept only on success, errors mapped to exit codes.

Every command turns a :class:`~qtool.errors.QtoolError` into one red line and its exit code;
anything else is a bug and is shown with a traceback (exit 70).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer

from qtool._version import __version__
from qtool.cli.app import STATE, StdoutClosed, err_console, fail
from qtool.errors import CheckFailedError, ExitCode, QtoolError

T = TypeVar("T")


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C (outputs not yet committed are removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def run_command(
    action: Callable[[], T],
    outputs: dict[str, Path | str | None] | None = None,
    inputs: tuple[Path | str | None, ...] = (),
) -> T:
    """Run a command body, mapping errors to messages and exit codes.

    Before any work, ``outputs`` (option -> path) are checked: writable, distinct, and never one of
    ``inputs`` (see :func:`qtool.system.outputs.check_outputs`). Every file the body writes is staged and
    committed together when it succeeds; on an error, Ctrl-C, SIGTERM or SIGHUP none is written.
    """
    from qtool.system.outputs import ENVIRONMENT_ERRNOS, check_outputs, protect, transaction

    files: dict[str, Path | str | None] = {
        k: v for k, v in (outputs or {}).items() if v is not None and not (k == "--json" and str(v) == "-")
    }
    started = time.time_ns()
    stopped: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else _Stopped(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, on_signal) for signum in _STOP_SIGNALS}
    try:
        _load_native_modules()
        known_inputs = _with_data_files(inputs)
        check_outputs(files, known_inputs)
        with transaction(keep_on=(CheckFailedError,)), warnings.catch_warnings():  # failed gates keep reports
            # numpy's RuntimeWarnings (overflow in a cast, 0/0) would print raw lines: what they warn of
            # (inf, NaN) is checked where it matters and reported as one error line
            warnings.simplefilter("ignore", RuntimeWarning)
            protect(known_inputs)
            return action()
    except QtoolError as e:
        if STATE["debug"]:
            traceback.print_exc()
        fail(_one_line(str(e)), e.exit_code)
    except KeyboardInterrupt as e:
        _interrupted(files, started, e.signum if isinstance(e, _Stopped) else signal.SIGINT)
    except typer.Exit:
        raise
    except StdoutClosed:
        _stdout_closed()
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            _internal_error(stopped, files, started)
        if STATE["debug"]:
            traceback.print_exc()
        fail(_one_line(f"{e.filename or 'I/O'}: {e.strerror or e}"), ExitCode.BAD_INPUT)
    except Exception:  # noqa: BLE001 - anything else is a qtool bug: show it, ask for a report
        _internal_error(stopped, files, started)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    raise AssertionError("unreachable")


def _load_native_modules() -> None:
    """Import onnx with the stop signals held back.

    A KeyboardInterrupt raised while onnx's native module initialises ends in C++'s terminate (the process
    aborts with no message and no cleanup); held back for that fraction of a second, the signal arrives just
    after the import, where the handlers above deal with it as with any other. (onnxruntime's native module
    turns one into an error of its own, which :func:`_internal_error` reports as the interruption it is.)
    """
    mask = getattr(signal, "pthread_sigmask", None)  # (Windows has no signal masks)
    previous = mask(signal.SIG_BLOCK, set(_STOP_SIGNALS)) if mask is not None else None
    try:
        import onnx  # noqa: F401
    finally:
        if mask is not None and previous is not None:
            mask(signal.SIG_SETMASK, previous)


def _internal_error(stopped: list[int], files: dict[str, Path | str | None], started: int) -> NoReturn:
    if stopped:  # a signal inside native code (onnxruntime's import) surfaces as its own error type
        _interrupted(files, started, stopped[0])
    traceback.print_exc()
    fail(f"internal error in qtool {__version__}; please report it with the traceback above", ExitCode.INTERNAL)
    raise AssertionError("unreachable")


def _with_data_files(inputs: tuple[Path | str | None, ...]) -> list[Path]:
    """The inputs, with the external data files of the models among them."""
    from qtool.calibration.remote import is_url, local_path
    from qtool.graph.model_files import model_files

    found: list[Path] = []
    for item in inputs:
        if item is None or str(item) == "-":
            continue
        if is_url(str(item)):  # a file:// dataset is this machine's files all the same
            local = local_path(str(item))
            if local is not None:
                found.extend(model_files(local))
            continue
        if not Path(item).exists():  # nothing there to protect (a config given by name, say): checked where read
            continue
        found.extend(model_files(item))
    return found


def _one_line(message: str) -> str:
    """A message as one line: control characters (newlines, terminal escapes) from file contents escaped."""
    from qtool.reports.terminal import printable

    return printable(message, markup=False)


def _stdout_closed() -> NoReturn:
    """The reader of stdout went away (``| head``): stop quietly, as a command killed by SIGPIPE would."""
    with suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush must not fail
    raise typer.Exit(128 + signal.SIGPIPE)


def _interrupted(files: dict[str, Path | str | None], started: int, signum: int) -> NoReturn:
    name = signal.Signals(signum).name
    from qtool.reports.terminal import printable

    paths = [Path(str(p)) for p in files.values()]
    written = [printable(str(p)) for p in paths if p.is_file() and p.stat().st_mtime_ns >= started]
    if written:  # a signal after the commit: the outputs are complete
        err_console.print(f"[red]interrupted[/red] ({name}) after writing {', '.join(written)} (complete)")
    else:
        err_console.print(f"[red]interrupted[/red] ({name}): no output was written", highlight=False)
    raise typer.Exit(128 + signum)
