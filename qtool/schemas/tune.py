"""The ``qtool tune --json`` document, read from tune's records by their attributes.

A field the records name otherwise says where it reads from (``validation_alias``): the document is
``TuneReport.model_validate(result, from_attributes=True)``, and no code copies fields one by one.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import AfterValidator, AliasChoices, AliasPath, Field

from qtool.schemas.reports.base import FiniteOrNull, _Report

TUNE_SCHEMA_VERSION = 5  # 2: sensitivity.cached/cache_file; 3: sensitivity.samples; 4: selection and validation;
# 5: samples name EVAL's files once each, with decode_steps

_Value = TypeVar("_Value")


def _by_node(mapping: dict[str, _Value]) -> dict[str, _Value]:
    return dict(sorted(mapping.items()))


class TunedFile(_Report):
    """A model file: where, its digest and size."""

    path: str
    sha256: str
    bytes: int = Field(validation_alias=AliasChoices("bytes", "size_bytes"))


class TuneSensitivity(_Report):
    """Each tuned node measured alone (noise-to-signal power per option; null: the option fails there)."""

    nodes: int
    builds: int
    seconds: float
    complete: bool  # false: the time budget cut the measurement short
    cached: bool  # true: read from cache_file (an earlier run's measurement), not measured in this run
    cache_file: str | None  # the tune cache file read or written; null: none (--no-cache, or not complete)
    samples: list[str]  # the sample files each node was measured on (--sensitivity-samples of the selection half)
    noise_to_signal: Annotated[dict[str, dict[str, FiniteOrNull]], AfterValidator(_by_node)] = Field(
        validation_alias=AliasChoices("noise_to_signal", "nsr")
    )
    measured: Annotated[dict[str, list[str]], AfterValidator(_by_node)]  # node -> options measured (the rest derived)


class TuneTrial(_Report):
    """One allocation built and verified on the selection samples."""

    size_bytes: int
    compression_ratio: float
    sqnr_db: FiniteOrNull  # worst output, the selection samples pooled; null: exact
    bound_db: FiniteOrNull  # its lower confidence bound (what the target is judged on); null: exact
    metric: FiniteOrNull  # the --metric's mean on the selection samples
    metric_bound: FiniteOrNull  # its confidence bound, on the worse side
    latency_ratio: FiniteOrNull
    latency_ratio_interval: list[float] | None
    predicted_sqnr_db: FiniteOrNull
    meets: bool
    note: str
    chosen: bool
    pareto: bool
    precisions: dict[str, int]  # option -> node count
    allocation: Annotated[dict[str, str], AfterValidator(_by_node)]  # node -> option, by node


class TuneValidation(_Report):
    """A model scored on the validation samples, which no choice saw."""

    samples: list[str]
    sqnr_db: FiniteOrNull
    bound_db: FiniteOrNull  # the lower confidence bound: the promise
    metric: FiniteOrNull
    metric_bound: FiniteOrNull
    meets: bool


class TuneRound(_Report):
    """One choice validated: a miss raises the selection margin by its shortfall."""

    trial: int = Field(validation_alias=AliasChoices("trial", AliasPath("choice", "trial")))  # index into trials
    # the margin (dB, or metric units) the choice was made with
    margin: float = Field(validation_alias=AliasChoices("margin", AliasPath("choice", "margin")))
    validation: TuneValidation


class TuneSamples(_Report):
    """Which EVAL files did what: no file both selects and validates."""

    selection: list[str]
    validation: list[str]
    sensitivity: list[str]  # the selection files each node was measured on
    decode_steps: bool = False  # a decoder's files: each scored as a prefill and as the decode step after it


class TuneReport(_Report):
    """What qtool tune tried, chose and wrote."""

    schema_version: int
    qtool_version: str
    model: TunedFile = Field(validation_alias=AliasChoices("model", "source"))
    output: TunedFile
    config_out: str
    goal: str
    objective: str
    met: bool  # the written model's validated bound reaches the goal
    reachable: bool  # some quantized candidate met the goal on the selection samples
    promise: str | None  # what the written model promises on new samples (when met)
    promise_db: FiniteOrNull  # the SQNR it promises there: the target (null: not met, or a metric goal)
    confidence: float  # of the selection bounds, and of the promise for all validated choices together
    validation_confidence: float  # of each validated choice's bound (confidence corrected for the choices)
    margin: float  # the selection margin of the last choice
    out_of_time: bool
    stalled: bool  # the refinement stopped when its candidates no longer made the model smaller
    seconds: float
    time_budget: float
    samples: TuneSamples
    sensitivity: TuneSensitivity
    written: TuneTrial  # the model written to -o, built from --config-out, on the selection samples
    validation: TuneValidation  # the written model on the validation samples
    rounds: list[TuneRound]
    trials: list[TuneTrial]
    notes: list[str]
