"""Calibration spread over an engine's workers: one shard of the samples each, merged exactly.

Each worker runs :func:`qtool.pipeline.calibrate.calibrate_shard` on shard ``k/n`` of the samples (every n-th file
from the k-th), exactly as ``qtool calibrate --shard k/n`` would, and sends back its statistics;
the client merges them in shard order. The histogram and min/max observers merge exactly, so
the result is byte for byte the statistics of one process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qtool.calibration.statistics import CalibrationStats
from qtool.config_files import resolve_config
from qtool.distributed import EngineSpec, open_engine
from qtool.options import CalibrationOptions
from qtool.progress import ProgressFactory, noop_progress


@dataclass(frozen=True)
class ShardRequest:
    """Everything a worker needs to calibrate one shard (paths as the workers will see them)."""

    model: str
    data: str
    config: str | dict[str, Any] | None
    options: CalibrationOptions  # ``shard`` says which shard
    target: str | None = None
    input_shapes: dict[str, tuple[int, ...]] | None = None

    @property
    def shard_text(self) -> str:
        assert self.options.shard is not None  # set for every request sent to a worker
        return f"{self.options.shard[0]}/{self.options.shard[1]}"


def shard_request(
    model: Path | str,
    data: Path | str,
    config: Path | str | Mapping[str, Any] | None,
    options: CalibrationOptions,
    target: str | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
) -> ShardRequest:
    """The request shared by every shard: local paths made absolute, the config a plain dict."""
    if isinstance(config, Mapping):
        sent: str | dict[str, Any] | None = dict(config)
    else:
        sent = _absolute(resolve_config(config)) if config is not None else None  # a name: the installed file
    shapes = {name: tuple(int(d) for d in dims) for name, dims in input_shapes.items()} if input_shapes else None
    return ShardRequest(_absolute(model), _absolute(data), sent, options, target, shapes)


def _absolute(path: Path | str) -> str:
    text = str(path)
    return text if "://" in text else str(Path(text).resolve())


ShardWork = Callable[[ShardRequest, Callable[[int], None]], dict[str, Any]]


def calibrate_on_workers(
    request: ShardRequest,
    samples: int,
    trusted: frozenset[str],
    progress: ProgressFactory | None,
    calibrate_shard: ShardWork,
) -> CalibrationStats:
    """Calibrate ``samples`` samples in shards over the engine ``request.options`` asks for.

    ``calibrate_shard`` runs on a worker: the statistics of one shard, as :meth:`CalibrationStats.to_dict`
    (:func:`qtool.pipeline.calibrate.calibrate_shard`).
    """
    options = request.options
    spec = EngineSpec(options.workers, options.scheduler, options.threads or 1)
    with open_engine(spec) as engine:
        shards = max(1, min(engine.workers, samples))
        one = replace(options, workers=None, scheduler=None, threads=spec.threads)
        requests = [replace(request, options=replace(one, shard=(k, shards))) for k in range(1, shards + 1)]
        advance = (progress or noop_progress)(f"calibrating on {shards} workers", samples)
        heard = [0]

        def on_progress(units: int) -> None:
            heard[0] += units
            advance(units)

        parts = engine.run(
            calibrate_shard,
            requests,
            describe=lambda r: f"calibrating shard {r.shard_text} of {r.data}",
            on_progress=on_progress,
        )
        if heard[0] < samples:  # the last workers' reports may still be on their way: the work is done
            advance(samples - heard[0])
    stats = [
        CalibrationStats.from_dict(part, f"shard {r.shard_text}", trusted)
        for part, r in zip(parts, requests, strict=False)
    ]
    return CalibrationStats.merge_all(stats)
