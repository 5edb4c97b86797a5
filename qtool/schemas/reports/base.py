"""The base of every JSON report model: unknown fields are refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")
