"""Reading the user's files: regular files only, of bounded size, with one clear error each.

A FIFO or a device (``-c /dev/zero``) would block or never end, and a huge file would be read
into memory before anything looks at it: both are refused before reading.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from qtool.errors import QtoolError

CONFIG_MAX_BYTES = 4 << 20  # a QConfigDict is a few KiB
JSON_MAX_DEPTH = 64  # qtool's own JSON files nest 5 levels deep


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular(path: Path | str, what: str, max_bytes: int | None = None) -> int:
    """Raise unless ``path`` is a regular file of at most ``max_bytes``; returns its size."""
    path = Path(path)
    try:
        status = path.stat()
    except FileNotFoundError:
        raise QtoolError(f"{what} not found: {path}") from None
    except OSError as e:
        raise QtoolError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if not stat.S_ISREG(status.st_mode):
        raise QtoolError(f"{what} {path} is {_kind(status.st_mode)}; qtool reads regular files only")
    if max_bytes is not None and status.st_size > max_bytes:
        raise QtoolError(
            f"{what} {path} is {status.st_size:,} bytes, over the {max_bytes:,}-byte limit for such files",
            hint="is it the right file?",
        )
    return status.st_size


def read_bytes(path: Path | str, what: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of bounded size (checked before reading, and while reading)."""
    size = check_regular(path, what, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a file swapped for a FIFO cannot block
        with os.fdopen(fd, "rb") as f:
            data = f.read(min(size, max_bytes) + 1)  # never a buffer larger than the file
    except OSError as e:
        raise QtoolError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if len(data) > max_bytes:
        raise QtoolError(f"{what} {path} grew past the {max_bytes:,}-byte limit while it was read")
    return data


def read_text(path: Path | str, what: str, max_bytes: int) -> str:
    """A UTF-8 text file (see :func:`read_bytes`)."""
    data = read_bytes(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QtoolError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def read_json(path: Path | str, what: str, max_bytes: int) -> Any:
    """A JSON document of bounded size and nesting depth, whose numbers are all finite.

    Every JSON file qtool reads comes through here: ``NaN``/``Infinity`` (not JSON, though Python
    writes them) and numbers too large for a float (``1e400``) are refused, naming the file.
    """
    text = read_text(path, what, max_bytes)
    try:
        document = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise QtoolError(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise QtoolError(f"{what} {path} nests deeper than {JSON_MAX_DEPTH} levels") from None
    except ValueError as e:  # a non-finite number, or an integer of more than 4300 digits
        raise QtoolError(f"{what} {path}: {e}") from None
    if _depth(document) > JSON_MAX_DEPTH:
        raise QtoolError(f"{what} {path} nests deeper than {JSON_MAX_DEPTH} levels")
    return document


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a JSON number (only finite numbers are)")


def _depth(value: Any) -> int:
    """Nesting depth, iteratively (a deep document must not exhaust the stack here either)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level > JSON_MAX_DEPTH:
            return level
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest
