"""The datasets a run reads, built from the options and the config, and the float passes that feed taps."""

from __future__ import annotations

from pathlib import Path

from qtool.calibration.dataset import Dataset, model_inputs, spread_positions
from qtool.calibration.remote import is_url, sample_files
from qtool.calibration.statistics import FloatPass, Observing, collect_statistics
from qtool.calibration.taps import BatchTap
from qtool.errors import QtoolError
from qtool.options import CalibrationOptions
from qtool.pipeline.workspace import Workspace
from qtool.quantization.algorithms.rounding.node_inputs import NodeInputCollector
from qtool.system.stages import stage


def calibration_dataset(
    ws: Workspace, data_dir: Path | str, options: CalibrationOptions, *, sharded: bool = True
) -> Dataset:
    """The calibration samples as calibrate reads them (limit, shard, preprocessing, NaN handling)."""
    config = ws.config
    return Dataset(
        data_dir,
        model_inputs(ws.model),
        limit=options.limit or config.calibration.limit,
        shard=options.shard if sharded else None,
        preprocess=config.preprocess,
        skip_nonfinite=options.skip_nonfinite,
    )


def spread_dataset(ws: Workspace, data_dir: Path | str, count: int, *, skip_nonfinite: bool = False) -> Dataset:
    """``count`` samples spread evenly over ``data_dir``."""
    return Dataset(
        data_dir, model_inputs(ws.model), spread=count, preprocess=ws.config.preprocess, skip_nonfinite=skip_nonfinite
    )


def full_dataset(ws: Workspace, data_dir: Path | str) -> Dataset:
    """Every sample of ``data_dir``, preprocessed as the config says."""
    return Dataset(data_dir, model_inputs(ws.model), preprocess=ws.config.preprocess)


def sample_count(ws: Workspace, data_dir: Path | str, options: CalibrationOptions) -> int:
    """How many samples calibration reads (a URL's are counted by listing it, without reading them)."""
    if not is_url(data_dir):
        return len(calibration_dataset(ws, data_dir, options))
    samples = len({relative.split("/")[0] for _, relative in sample_files(str(data_dir))})
    if samples == 0:
        raise QtoolError(f"data directory {data_dir} holds no samples")
    limit = options.limit or ws.config.calibration.limit
    return min(samples, limit) if limit else samples


def tapped_pass(
    ws: Workspace,
    data_dir: Path | str,
    options: CalibrationOptions,
    taps: list[BatchTap],
    what: str,
    samples: int | None = None,
    held_out: frozenset[Path] = frozenset(),
) -> None:
    """One float pass over the calibration samples (unsharded; ``samples`` of them, spread) that feeds ``taps``.

    ``held_out``: sample files the pass must not read (those a choice validates on), unless no other is left.
    """
    dataset = calibration_dataset(ws, data_dir, options, sharded=False)
    kept = [i for i, path in enumerate(dataset.files) if path.resolve() not in held_out]
    if kept and len(kept) < len(dataset):
        dataset = dataset.subset(kept)
    if samples is not None and samples < len(dataset):
        dataset = dataset.subset(spread_positions(len(dataset), samples))
    for tap in taps:
        if isinstance(tap, NodeInputCollector):
            tap.expect(len(dataset))
    with stage(f"{what} (float pass)"):
        batch_size = options.batch_size or ws.config.calibration.batch_size
        run = FloatPass(batch_size, weights=ws.weights)
        collect_statistics(ws.prepared, [], dataset, Observing(ws.config.calibration.observer), run, taps=taps)
