"""Every file a command writes: checked before any work, and kept only if the whole command succeeds.

A command opens one :func:`transaction`. :func:`qtool.graph.model_io.atomic_writer` writes each output
to a temporary file beside it (created inside the cleanup scope) and renames it into place, so the
command can read its own outputs back (quantize evaluates the model it wrote); the transaction
first keeps a hard link to the file it replaces. When the command fails, is interrupted (Ctrl-C,
SIGTERM, SIGHUP) or a later output cannot be written, every output is put back as it was: new
files are removed and replaced ones restored. On success the kept copies are dropped.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from qtool.errors import QtoolError

# Failures of the user's environment, not of qtool: reported in one line with exit 2.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.ENOENT,
    errno.EFBIG,
    errno.ENAMETOOLONG,
    errno.EMFILE,
    errno.ENFILE,
    errno.EIO,
}


def environment_error(error: OSError, action: str, path: Path | str) -> QtoolError:
    """A QtoolError for an OSError the environment caused (disk full, read-only, no permission)."""
    cause = error.strerror or type(error).__name__
    return QtoolError(f"cannot {action} {path}: {cause}")


@dataclass
class Transaction:
    """Outputs written so far and how to undo them, and what to do once all are final."""

    undo: dict[Path, Path | None] = field(default_factory=dict)  # output -> kept previous file (None: new)
    protected: set[tuple[int, int]] = field(default_factory=set)  # (device, inode) of the command's inputs
    after: list[Callable[[], None]] = field(default_factory=list)  # run once everything is final

    def place(self, temporary: Path, final: Path) -> None:
        """Rename ``temporary`` over ``final``, first keeping what ``final`` held for :meth:`abort`."""
        if final not in self.undo:
            self.undo[final] = _keep(final) if final.exists() else None
        os.replace(temporary, final)

    def commit(self) -> None:
        for kept in self.undo.values():
            if kept is not None:
                kept.unlink(missing_ok=True)
        self.undo.clear()
        for action in self.after:
            action()
        self.after.clear()

    def abort(self) -> None:
        for final, kept in reversed(self.undo.items()):
            if kept is None:
                final.unlink(missing_ok=True)
            else:
                os.replace(kept, final)
        self.undo.clear()
        self.after.clear()


def _keep(path: Path) -> Path:
    """A hidden hard link (or, where links are not allowed, a copy) of ``path`` beside it."""
    kept = path.with_name(f".{path.name}.{os.getpid()}.previous")
    kept.unlink(missing_ok=True)
    try:
        os.link(path, kept)
    except OSError:
        shutil.copy2(path, kept)
    return kept


_CURRENT: ContextVar[Transaction | None] = ContextVar("qtool_outputs", default=None)


@contextmanager
def transaction(keep_on: tuple[type[BaseException], ...] = ()) -> Iterator[Transaction]:
    """Keep every output written inside the block only if it ends without error.

    ``keep_on``: exceptions that still keep the outputs (a failed gate: its reports are the result).
    Nested blocks join the outermost transaction, so a library call inside a CLI command commits
    together with the command's other outputs.
    """
    outer = _CURRENT.get()
    if outer is not None:
        yield outer
        return
    tx = Transaction()
    token = _CURRENT.set(tx)
    try:
        yield tx
    except keep_on:
        tx.commit()
        raise
    except BaseException:
        tx.abort()
        raise
    else:
        tx.commit()
    finally:
        _CURRENT.reset(token)


def finish(temporary: Path, final: Path) -> None:
    """Rename a fully written temporary file over ``final`` (undone if the transaction fails)."""
    tx = _CURRENT.get()
    try:
        if tx is not None:
            tx.place(temporary, final)
        else:
            os.replace(temporary, final)
    except OSError as e:
        raise environment_error(e, "write", final) from e


def protect(inputs: Iterable[Path | str | None]) -> None:
    """Mark the files of ``inputs`` (folders: every file under them) as never to be deleted or replaced."""
    tx = _CURRENT.get()
    if tx is not None:
        tx.protected.update(_input_files(inputs))


def is_protected(path: Path) -> bool:
    """Whether ``path`` is an input of the running command (see :func:`protect`)."""
    tx = _CURRENT.get()
    identity = _identity(path)
    return tx is not None and identity is not None and identity in tx.protected


def after_commit(action: Callable[[], None]) -> None:
    """Run ``action`` once every output is in place (now, outside a transaction)."""
    tx = _CURRENT.get()
    if tx is not None:
        tx.after.append(action)
    else:
        action()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()  # follows symlinks: a link to an input is that input
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _input_files(inputs: Iterable[Path | str | None]) -> dict[tuple[int, int], Path]:
    """Identity (device, inode) of every input file; folders contribute the files under them."""
    found: dict[tuple[int, int], Path] = {}
    for item in inputs:
        if item is None or str(item) == "-":
            continue
        path = Path(item)
        if path.is_dir():
            seen: set[Path] = set()
            for root, dirs, files in os.walk(path, followlinks=True):  # a linked sample folder is an input too
                real = Path(root).resolve()
                if real in seen:  # a link loop
                    dirs.clear()
                    continue
                seen.add(real)
                for name in files:
                    file = Path(root) / name
                    identity = _identity(file)
                    if identity:
                        found.setdefault(identity, file)
            continue
        identity = _identity(path)
        if identity:
            found.setdefault(identity, path)
    return found


def check_outputs(outputs: dict[str, Path | str | None], inputs: Iterable[Path | str | None]) -> None:
    """Refuse, before any work, outputs that cannot be written or that would replace an input.

    Args:
        outputs: option name (e.g. ``--json``) -> path (None: not asked for); ``-`` is refused here,
            so a caller that lets an option write to standard output leaves it out.
        inputs: every file or folder the command reads (models with their data files, samples,
            statistics, configs); an output may not be any of them, by name, symlink or hard link.

    Raises:
        QtoolError: naming the option, the path and why.
    """
    taken = _input_files(inputs)
    seen: dict[Path, str] = {}
    for option, value in outputs.items():
        if value is None:
            continue
        if str(value) == "-":
            raise QtoolError(f"{option} - : this output is a file", hint="give a path (only --json - writes to stdout)")
        path = Path(value)
        where = f"{option} {path}"
        if path.is_dir():
            raise QtoolError(f"{where} is a directory", hint="give a file path")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise QtoolError(f"{where}: folder {parent} does not exist", hint="create it first")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise QtoolError(f"{where}: folder {parent} is not writable (read-only or no permission)")
        if path.exists() and not path.is_file():
            raise QtoolError(f"{where} exists and is not a regular file")
        identity = _identity(path)
        if identity in taken:
            raise QtoolError(
                f"{where} is the input {taken[identity]}; qtool never overwrites its inputs",
                hint="choose another output path",
            )
        resolved = path.resolve()
        if resolved in seen:
            raise QtoolError(f"{where} is also given as {seen[resolved]}", hint="give each output its own path")
        seen[resolved] = option
