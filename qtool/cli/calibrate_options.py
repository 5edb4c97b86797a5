"""``qtool calibrate``'s own options, each declared once, and the command's work on the record they fill."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qtool.cli.app import parse_shard, progress_bars, summary_console, write_json
from qtool.cli.options import DataLocation, calibration_options

if TYPE_CHECKING:
    from qtool.calibration.statistics import CalibrationStats

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


@dataclass(frozen=True)
class CalibrateArgs:
    """What ``qtool calibrate`` was given, option by option."""

    model: Path
    data_dir: DataLocation
    output: Path
    config: Path | None
    input_shapes: str | None
    target: str | None
    observer: str | None
    observer_option: list[str] | None
    batch_size: int | None
    limit: int | None
    shard: str | None
    skip_nonfinite: bool
    workers: int | None
    scheduler: str | None
    threads: int | None
    tensorrt_cache: Path | None
    tensorrt_version: str | None
    json_out: str | None


def calibrate_action(args: CalibrateArgs) -> None:
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
    from qtool.graph.input_shapes import parse_input_shapes
    from qtool.graph.model_io import tensor_names

    version = args.tensorrt_version or installed_tensorrt_version() or DEFAULT_VERSION
    if args.tensorrt_cache is not None:
        tensorrt_version_number(version)  # a malformed version fails before any work
        check_cache_names(tensor_names(args.model))  # so does a name the cache's lines cannot hold
    with progress_bars() as progress:
        options = calibration_options(
            args, shard=parse_shard(args.shard), threads=args.threads, workers=args.workers, scheduler=args.scheduler
        )
        stats = run_calibrate(
            args.model,
            args.data_dir,
            config_path=args.config,
            options=options,
            progress=progress,
            target=args.target,
            input_shapes=parse_input_shapes(args.input_shapes) if args.input_shapes else None,
        )
    cache_text, left_out = None, list[str]()
    if args.tensorrt_cache is not None:
        cache_text, left_out = tensorrt_cache_text(stats.tensors, version, model_tensor_names(args.model))
    write_stats(stats, args.output)
    if args.tensorrt_cache is not None and cache_text is not None:
        from qtool.graph.model_io import write_text

        write_text(args.tensorrt_cache, cache_text)
    _reported(args, stats, left_out)


def _reported(args: CalibrateArgs, stats: CalibrationStats, left_out: list[str]) -> None:
    """The summary lines (what the TensorRT cache left out, skipped samples), and the JSON asked for."""
    from qtool.reports.documents import stats_summary_dict, to_json
    from qtool.reports.terminal import printable

    console = summary_console(args.json_out)
    if left_out:
        console.print(
            f"[yellow]note[/yellow] {len(left_out)} observed tensors are not tensors of {printable(str(args.model))} "
            f"(first: {printable(left_out[0])}): left out of the TensorRT cache"
        )
    if stats.skipped:
        console.print(f"[yellow]skipped[/yellow] {stats.skipped} samples holding NaN or Inf")
    console.print(
        f"[green]wrote[/green] {printable(str(args.output))}: {len(stats.tensors)} tensors observed with "
        f"'{printable(stats.observer)}' over {stats.samples} samples"
    )
    if args.json_out:
        write_json(args.json_out, to_json(stats_summary_dict(stats, str(args.output))))
