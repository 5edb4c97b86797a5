"""The ``qtool tune --json`` document."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TunedFile(_Report):
    """A model file: where, its digest and size."""

    path: str
    sha256: str
    bytes: int


class TuneSensitivity(_Report):
    """Each tuned node measured alone (noise-to-signal power per option; null: the option fails there)."""

    nodes: int
    builds: int
    seconds: float
    complete: bool  # false: the time budget cut the measurement short
    cached: bool  # true: read from cache_file (an earlier run's measurement), not measured in this run
    cache_file: str | None  # the tune cache file read or written; null: none (--no-cache, or not complete)
    samples: list[str]  # the evaluation sample files each node was measured on (--sensitivity-samples of EVAL)
    noise_to_signal: dict[str, dict[str, float | None]]
    measured: dict[str, list[str]]  # node -> options measured (the rest derived)


class TuneTrial(_Report):
    """One allocation built and verified on the evaluation samples."""

    size_bytes: int
    compression_ratio: float
    sqnr_db: float | None  # worst output; null: exact
    metric: float | None
    latency_ratio: float | None
    latency_ratio_interval: list[float] | None
    predicted_sqnr_db: float | None
    meets: bool
    note: str
    chosen: bool
    pareto: bool
    precisions: dict[str, int]  # option -> node count
    allocation: dict[str, str]  # node -> option


class TuneReport(_Report):
    """What qtool tune tried, chose and wrote."""

    schema_version: int
    qtool_version: str
    model: TunedFile
    output: TunedFile
    config_out: str
    goal: str
    objective: str
    met: bool
    out_of_time: bool
    seconds: float
    sensitivity: TuneSensitivity
    written: TuneTrial  # the model written to -o, built from --config-out and measured on EVAL
    trials: list[TuneTrial]
    notes: list[str]
