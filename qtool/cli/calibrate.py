"""``qtool calibrate`` and ``qtool merge``: statistics in, statistics out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, parse_observer_options, parse_shard, progress_bars, summary_console, write_json
from qtool.cli.options import (
    BatchOption,
    ConfigOption,
    DataLocation,
    InputShapesOption,
    JsonOption,
    LimitOption,
    ObserverOption,
    ObserverOptionsOption,
    SchedulerOption,
    ShardOption,
    SkipNonfiniteOption,
    TargetOption,
    ThreadsOption,
    WorkersOption,
)
from qtool.cli.run import run_command
from qtool.options import CalibrationOptions


@app.command()
def calibrate(
    model: Annotated[Path, typer.Argument(help="Float ONNX model.", show_default=False, metavar="MODEL")],
    data_dir: Annotated[
        DataLocation,
        typer.Argument(
            parser=DataLocation,
            help="Directory of samples (*.npy, *.npz, images, test_data_set_*), or an fsspec URL "
            "(s3://, gs://, https://; the 'remote' extra).",
            show_default=False,
            metavar="DATA_DIR",
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="PATH", help="Statistics JSON file to write.")],
    config: ConfigOption = None,
    input_shapes: InputShapesOption = None,
    target: TargetOption = None,
    observer: ObserverOption = None,
    observer_option: ObserverOptionsOption = None,
    batch_size: BatchOption = None,
    limit: LimitOption = None,
    shard: ShardOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    workers: WorkersOption = None,
    scheduler: SchedulerOption = None,
    threads: ThreadsOption = None,
    tensorrt_cache: Annotated[
        Path | None,
        typer.Option(
            "--tensorrt-cache",
            metavar="FILE",
            help="Also write TensorRT's INT8 calibration cache (for trtexec --calib=FILE): "
            "a symmetric int8 scale per observed tensor.",
        ),
    ] = None,
    tensorrt_version: Annotated[
        str | None,
        typer.Option(
            "--tensorrt-version",
            metavar="X.Y.Z",
            help="TensorRT version named in the cache header (default: the installed tensorrt package's, else 10.0.0).",
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Run the float model over DATA_DIR and write activation statistics to -o STATS.json."""

    def action() -> None:
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
        from qtool.reports.documents import stats_summary_dict, to_json
        from qtool.reports.terminal import printable

        version = tensorrt_version or installed_tensorrt_version() or DEFAULT_VERSION
        if tensorrt_cache is not None:
            tensorrt_version_number(version)  # a malformed version fails before any work
            check_cache_names(tensor_names(model))  # so does a name the cache's lines cannot hold
        with progress_bars() as progress:
            options = CalibrationOptions(
                observer=observer,
                observer_options=parse_observer_options(observer_option),
                batch_size=batch_size,
                limit=limit,
                shard=parse_shard(shard),
                skip_nonfinite=skip_nonfinite,
                threads=threads,
                workers=workers,
                scheduler=scheduler,
            )
            stats = run_calibrate(
                model,
                data_dir,
                config_path=config,
                options=options,
                progress=progress,
                target=target,
                input_shapes=parse_input_shapes(input_shapes) if input_shapes else None,
            )
        cache_text, left_out = None, list[str]()
        if tensorrt_cache is not None:
            cache_text, left_out = tensorrt_cache_text(stats.tensors, version, model_tensor_names(model))
        write_stats(stats, output)
        if tensorrt_cache is not None and cache_text is not None:
            from qtool.graph.model_io import write_text

            write_text(tensorrt_cache, cache_text)
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

    outputs = {"-o": output, "--json": json_out, "--tensorrt-cache": tensorrt_cache}
    run_command(action, outputs, (model, data_dir, config))


@app.command()
def merge(
    stats: Annotated[
        list[Path],
        typer.Argument(help="Statistics files of shards of one dataset.", show_default=False, metavar="STATS.json..."),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="PATH", help="Merged statistics JSON file to write.")
    ],
    json_out: JsonOption = None,
) -> None:
    """Merge statistics of dataset shards (from 'qtool calibrate --shard K/N') into one file."""

    def action() -> None:
        from qtool.api import merge_stats, write_stats
        from qtool.reports.documents import stats_summary_dict, to_json
        from qtool.reports.terminal import printable

        merged = merge_stats(list(stats))
        write_stats(merged, output)
        summary_console(json_out).print(
            f"[green]wrote[/green] {printable(str(output))}: merged {len(stats)} files, "
            f"{merged.samples} samples, {len(merged.tensors)} tensors"
        )
        if json_out:
            write_json(json_out, to_json(stats_summary_dict(merged, str(output))))

    run_command(action, {"-o": output, "--json": json_out}, tuple(stats))
