"""The statistics file ``qtool calibrate`` writes, as a pydantic model (see :mod:`qtool.calibration.statistics`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qtool.errors import QtoolError

STATS_FORMAT = "qtool-calibration-stats"
STATS_VERSION = 1
Count = Annotated[int, Field(ge=0)]


class TensorStatistics(BaseModel):
    """One tensor's observer and its serialised state (the observer checks the state's contents)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    observer: str = Field(description="built-in or plugin name, or package.module:Class")
    axis: Annotated[int, Field(ge=-64, le=63)] | None = Field(default=None, description="channel axis; null per tensor")
    options: dict[str, Any] | None = None
    state: dict[str, Any] | None = Field(default=None, description="the observer's own state, e.g. {min, max}")


class StatsFile(BaseModel):
    """Activation statistics of one model over one dataset (or one shard of it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["qtool-calibration-stats"]
    version: Literal[1]
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the model file and its data files")
    observer: str
    samples: Count
    shard: str | None = Field(default=None, pattern=r"^[0-9]{1,9}/[0-9]{1,9}$", description="'K/N', or null")
    skipped: Count = 0
    elements: dict[str, Count] = Field(default_factory=dict, description="per-sample element count per tensor")
    tensors: dict[str, TensorStatistics]
    smoothing: dict[str, list[float]] = Field(
        default_factory=dict, description="SmoothQuant: per activation tensor, each channel's abs max"
    )
    equalized: list[str] = Field(default_factory=list, description="'first -> second' Conv pairs equalized")

    @field_validator("shard")
    @classmethod
    def _shard_exists(cls, value: str | None) -> str | None:
        if value is not None:
            k, n = (int(v) for v in value.split("/"))
            if not 1 <= k <= n:
                raise ValueError(f"shard {value} does not exist (1 <= K <= N)")
        return value


def parse_stats(data: Any, source: str) -> StatsFile:
    """Validate a statistics document; the first problem is one QtoolError naming the field."""
    if not isinstance(data, dict) or data.get("format") != STATS_FORMAT:
        raise QtoolError(f"{source} is not a qtool statistics file (missing format '{STATS_FORMAT}')")
    if data.get("version") != STATS_VERSION:
        raise QtoolError(
            f"{source}: unsupported statistics version {data.get('version')!r}",
            hint=f"this qtool reads version {STATS_VERSION}; re-run qtool calibrate",
        )
    if isinstance(data.get("elements"), type(None)):
        data = {**data, "elements": {}}
    try:
        return StatsFile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise QtoolError(f"{source}: field '{where}': {message}, got {first.get('input')!r:.80}") from None
