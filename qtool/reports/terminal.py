"""Text from models and files made safe for a terminal; JSON keeps it exact.

Node, tensor and file names come from the user's files and can hold newlines, ANSI/OSC escape
sequences or Rich markup (``[red]``). Shown raw they would forge lines (a fake ``error:``), clear
the screen or restyle a report. Every human-readable output passes its records through
:func:`for_terminal` (or single strings through :func:`printable`) first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from rich.markup import escape

T = TypeVar("T")


def printable(text: str, *, markup: bool = True) -> str:
    r"""``text`` with control characters as escapes (``\n``, ``\x1b``) and, for Rich, markup escaped."""
    if text.isprintable():
        shown = text
    else:
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return escape(shown) if markup else shown


def for_terminal(value: T) -> T:
    """A copy of ``value`` (records, lists, dicts, tuples) with every string made :func:`printable`."""
    converted: T = _convert(value)
    return converted


def _convert(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, (bool, int, float, bytes)) or value is None:
        return value
    if isinstance(value, list):
        return [_convert(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_convert(v) for v in value)
    if isinstance(value, dict):
        return {_convert(k): _convert(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copy = object.__new__(type(value))
        for f in dataclasses.fields(value):
            object.__setattr__(copy, f.name, _convert(getattr(value, f.name)))
        return copy
    fields = getattr(type(value), "model_fields", None)  # a pydantic model (the reports' records): read, not imported,
    if isinstance(fields, dict) and hasattr(value, "model_copy"):  # so that the CLI starts without pydantic
        return value.model_copy(update={name: _convert(getattr(value, name)) for name in fields})
    return value
