"""``qtool calibrate``'s own options, each declared once, and the command's work on the record they fill."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qtool.cli.app import parse_shard, progress_bars, summary_console, write_json
from qtool.cli.groups import OptionGroup
from qtool.cli.options import (
    Calibration,
    DataLocation,
    LimitOption,
    SchedulerOption,
    Setup,
    ShardOption,
    SkipNonfiniteOption,
    ThreadsOption,
    WorkersOption,
)

if TYPE_CHECKING:
    from qtool.calibration.statistics import CalibrationStats
    from qtool.options import CalibrationOptions

DataDirArgument = Annotated[
    DataLocation,
    typer.Argument(
        parser=DataLocation,
        help="Directory of samples (*.npy, *.npz, images, test_data_set_*), or an fsspec URL "
        "(s3://, gs://, https://; the 'remote' extra).",
        show_default=False,
        metavar="DATA_DIR",
    ),
]
CalibrateOutputOption = Annotated[
    Path, typer.Option("--output", "-o", metavar="PATH", help="Statistics JSON file to write.")
]
TensorrtCacheOption = Annotated[
    Path | None,
    typer.Option(
        "--tensorrt-cache",
        metavar="FILE",
        help="Also write TensorRT's INT8 calibration cache (for trtexec --calib=FILE): "
        "a symmetric int8 scale per observed tensor.",
    ),
]
TensorrtVersionOption = Annotated[
    str | None,
    typer.Option(
        "--tensorrt-version",
        metavar="X.Y.Z",
        help="TensorRT version named in the cache header (default: the installed tensorrt package's, else 10.0.0).",
    ),
]


@dataclass(frozen=True, kw_only=True)
class Calibrating(OptionGroup):
    """calibrate's samples: the shared calibration flags, and how the samples are sharded or spread.

    --limit and --skip-nonfinite stand here, not as the Sampling group: --shard sits between them.
    """

    calibration: Calibration = field(default_factory=Calibration)
    limit: LimitOption = None
    shard: ShardOption = None
    skip_nonfinite: SkipNonfiniteOption = False
    workers: WorkersOption = None
    scheduler: SchedulerOption = None
    threads: ThreadsOption = None

    def options(self) -> CalibrationOptions:
        """The record (--shard and --observer-option parsed, in that order)."""
        return self.calibration.options(self, shard=parse_shard(self.shard))


@dataclass(frozen=True, kw_only=True)
class TensorrtCache(OptionGroup):
    """TensorRT's INT8 calibration cache, written beside the statistics when asked for."""

    tensorrt_cache: TensorrtCacheOption = None
    tensorrt_version: TensorrtVersionOption = None


def calibrate_action(
    model: Path,
    data_dir: DataLocation,
    output: Path,
    setup: Setup,
    calibrating: Calibrating,
    tensorrt: TensorrtCache,
    json_out: str | None,
) -> None:
    """Calibrate, write the statistics (and the TensorRT cache asked for), report."""
    from qtool.api import calibrate as run_calibrate
    from qtool.api import write_stats
    from qtool.calibration.tensorrt_cache import (
        DEFAULT_VERSION,
        check_cache_names,
        installed_tensorrt_version,
        model_tensor_names,
        tensorrt_cache_text,
        tensorrt_version_number,
    )
    from qtool.graph.model_io import tensor_names

    version = tensorrt.tensorrt_version or installed_tensorrt_version() or DEFAULT_VERSION
    if tensorrt.tensorrt_cache is not None:
        tensorrt_version_number(version)  # a malformed version fails before any work
        check_cache_names(tensor_names(model))  # so does a name the cache's lines cannot hold
    with progress_bars() as progress:
        stats = run_calibrate(
            model,
            data_dir,
            config_path=setup.config,
            options=calibrating.options(),
            progress=progress,
            target=setup.target,
            input_shapes=setup.shapes(),
        )
    cache_text, left_out = None, list[str]()
    if tensorrt.tensorrt_cache is not None:
        cache_text, left_out = tensorrt_cache_text(stats.tensors, version, model_tensor_names(model))
    write_stats(stats, output)
    if tensorrt.tensorrt_cache is not None and cache_text is not None:
        from qtool.graph.model_io import write_text

        write_text(tensorrt.tensorrt_cache, cache_text)
    _reported(model, output, json_out, stats, left_out)


def _reported(model: Path, output: Path, json_out: str | None, stats: CalibrationStats, left_out: list[str]) -> None:
    """The summary lines (what the TensorRT cache left out, skipped samples), and the JSON asked for."""
    from qtool.reports.documents import stats_summary_dict, to_json
    from qtool.reports.terminal import printable

    console = summary_console(json_out)
    if left_out:
        console.print(
            f"[yellow]note[/yellow] {len(left_out)} observed tensors are not tensors of {printable(str(model))} "
            f"(first: {printable(left_out[0])}): left out of the TensorRT cache"
        )
    if stats.skipped:
        console.print(f"[yellow]skipped[/yellow] {stats.skipped} samples holding NaN or Inf")
    console.print(
        f"[green]wrote[/green] {printable(str(output))}: {len(stats.tensors)} tensors observed with "
        f"'{printable(stats.observer)}' over {stats.samples} samples"
    )
    if json_out:
        write_json(json_out, to_json(stats_summary_dict(stats, str(output))))
