"""The base of every JSON report model (unknown fields are refused), and the number types reports share."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _null_is_infinite(value: object) -> object:
    return math.inf if value is None else value


Decibels = Annotated[
    float,
    BeforeValidator(_null_is_infinite),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "null"}]}),
]
"""An SQNR in dB that the library computes with as a float: infinite (an exact match) is written as JSON null
(JSON has no Infinity), and null reads back as infinite."""
