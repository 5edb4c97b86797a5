"""What each stage may be told, as small frozen records (instead of long keyword lists).

``None`` in a field means "as the config says" (``calibration.*``, ``accuracy.*``) or the stage's
own default. :func:`qtool.api.quantize` takes one record per stage it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DECODE_STEPS = 16  # greedy steps a decoder continues each sample for (compare, tune, the placement choice)


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
    outputs: tuple[str, ...] = ()  # overrides accuracy.outputs: the outputs the target judges
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
    decode_steps: int = DECODE_STEPS  # decoders: tokens generated per sample through the cache (0: no decode loop)
    outputs: tuple[str, ...] = ()  # the outputs the gates judge, names or re: patterns (empty: all but the state)
    state: tuple[tuple[str, str], ...] = ()  # (output, input) state pairs given by the config (empty: recognised)


QUANTIZE_EVALUATION = EvaluationOptions(runs=20, warmup=3)  # the quick check quantize --data runs


@dataclass(frozen=True)
class OutputOptions:
    """How the quantized model is written."""

    external_data: bool | None = None  # True: weights in a data file; None: only past protobuf's 2 GiB
    opset: int | None = None  # the output's default-domain opset (None: see qtool.graph.opsets)


@dataclass(frozen=True)
class TuneOptions:
    """What ``qtool tune`` must reach and how long it may look (see :func:`qtool.api.tune`)."""

    target_sqnr_db: float | None = None  # the worst output's SQNR on the evaluation samples must reach this
    metric: str | None = None  # module:function scored per evaluation sample (instead of SQNR)
    target_metric: float | None = None  # the metric's mean must reach this
    lower_is_better: bool = False  # the metric is an error: it must stay at or below target_metric
    labels: Path | str | None = None  # one label per evaluation sample, passed to the metric
    target_decode: float | None = None  # a decoder's mean free-running greedy agreement must reach this (0..1]
    decode_steps: int = DECODE_STEPS  # greedy steps per sample for target_decode
    max_latency_ratio: float | None = None  # candidate / float time bound (CPU, timed interleaved)
    objective: str = "size"  # size | latency: what the chosen model minimises among those meeting the target
    time_budget: float = 600.0  # seconds; the search stops with the best result so far
    sensitivity_samples: int = 8  # selection samples each node is measured on, spread over them
    confidence: float = 0.9  # one-sided: the promise is the validated figure's lower bound at this confidence
    latency_runs: int = 30  # timed rounds per candidate when latency matters
    threads: int | None = None  # onnxruntime intra-op threads
    cache: bool = True  # keep and reuse the per-node sensitivity between runs (qtool.choice.tune.cache)
    cache_dir: Path | str | None = None  # where (None: $QTOOL_CACHE_DIR, else ~/.cache/qtool)
    outputs: tuple[str, ...] = ()  # the outputs the target judges (overrides accuracy.outputs)


# The defaults, as shared immutable values (the records are frozen).
DEFAULT_CALIBRATION = CalibrationOptions()
DEFAULT_SEARCH = SearchOptions()
DEFAULT_EVALUATION = EvaluationOptions()
DEFAULT_OUTPUT = OutputOptions()
DEFAULT_TUNE = TuneOptions(target_sqnr_db=30.0)
