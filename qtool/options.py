"""What each stage may be told, as small frozen records (instead of long keyword lists).

``None`` in a field means "as the config says" (``calibration.*``, ``accuracy.*``) or the stage's
own default. :func:`qtool.api.quantize` takes one record per stage it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CalibrationOptions:
    """How to observe activations (over the config's ``calibration:`` section)."""

    observer: str | None = None  # a name or package.module:Class; overrides calibration.observer
    observer_options: Mapping[str, Any] = field(default_factory=dict)  # over the config's options
    batch_size: int | None = None  # overrides calibration.batch_size
    limit: int | None = None  # only the first N samples; overrides calibration.limit
    shard: tuple[int, int] | None = None  # (k, n): the k-th of n interleaved shards of the samples
    skip_nonfinite: bool = False  # skip samples holding NaN/Inf instead of failing
    threads: int | None = None  # onnxruntime intra-op and observer threads per process (None: all cores; 1 per worker)
    workers: int | None = None  # spread the samples over this many local Dask worker processes
    scheduler: str | None = None  # ... or over the workers of a running Dask scheduler at this address


@dataclass(frozen=True)
class SearchOptions:
    """The sensitivity search (over the config's ``accuracy:`` section)."""

    target_sqnr_db: float | None = None  # overrides accuracy.target_sqnr_db
    max_float_nodes: int | None = None  # overrides accuracy.max_float_nodes
    samples: int | None = None  # overrides accuracy.samples
    search_seconds: float | None = None  # overrides accuracy.search_seconds
    latency_runs: int | None = None  # overrides accuracy.latency_runs (0: no timing)
    data_dir: Path | str | None = None  # samples to search on (default: the calibration data)


@dataclass(frozen=True)
class EvaluationOptions:
    """How to compare a candidate with its reference."""

    runs: int = 50  # timed runs per model and provider (0: no latency)
    warmup: int = 5  # untimed runs before timing
    threads: int | None = None  # onnxruntime intra-op threads (None: onnxruntime's choice)
    limit: int | None = None  # only the first N samples for accuracy
    skip_nonfinite: bool = False
    task: str = "auto"  # auto | classification | none
    per_layer: bool = False  # pair every intermediate float tensor
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    trt_engine_cache: str | None = None  # TensorRT: keep built engines in this directory between runs


QUANTIZE_EVALUATION = EvaluationOptions(runs=20, warmup=3)  # the quick check quantize --data runs


@dataclass(frozen=True)
class OutputOptions:
    """How the quantized model is written."""

    external_data: bool | None = None  # True: weights in a data file; None: only past protobuf's 2 GiB
    opset: int | None = None  # the output's default-domain opset (None: see qtool.graph.opsets)


# The defaults, as shared immutable values (the records are frozen).
DEFAULT_CALIBRATION = CalibrationOptions()
DEFAULT_SEARCH = SearchOptions()
DEFAULT_EVALUATION = EvaluationOptions()
DEFAULT_OUTPUT = OutputOptions()
