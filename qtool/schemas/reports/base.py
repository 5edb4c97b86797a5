"""The base of every JSON report model (unknown fields are refused), and the number types reports share."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, WithJsonSchema


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Record(_Report):
    """A report model that is also the library's record of what was measured: built once, never changed."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _null_is_infinite(value: object) -> object:
    return math.inf if value is None else value


def _finite_or_null(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


Decibels = Annotated[
    float,
    BeforeValidator(_null_is_infinite),
    PlainSerializer(_finite_or_null),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "null"}]}),
]
"""An SQNR in dB that the library computes with as a float: one that is not finite (an exact match is
infinite) is written as JSON null (JSON has no Infinity), and null reads back as infinite."""

FiniteOrNull = Annotated[float | None, PlainSerializer(_finite_or_null)]
"""A number that may be missing (None) or, as measured, not finite: written as null either way."""
