"""``qtool calibrate`` and ``qtool merge``: statistics in, statistics out."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, summary_console, write_json
from qtool.cli.calibrate_options import (
    CalibrateArgs,
    CalibrateOutputOption,
    DataDirArgument,
    TensorrtCacheOption,
    TensorrtVersionOption,
    calibrate_action,
)
from qtool.cli.options import (
    BatchOption,
    ConfigOption,
    InputShapesOption,
    JsonOption,
    LimitOption,
    ModelArgument,
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


@app.command()
def calibrate(
    model: ModelArgument,
    data_dir: DataDirArgument,
    output: CalibrateOutputOption,
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
    tensorrt_cache: TensorrtCacheOption = None,
    tensorrt_version: TensorrtVersionOption = None,
    json_out: JsonOption = None,
) -> None:
    """Run the float model over DATA_DIR and write activation statistics to -o STATS.json."""
    args = CalibrateArgs(**locals())

    outputs = {"-o": output, "--json": json_out, "--tensorrt-cache": tensorrt_cache}
    run_command(partial(calibrate_action, args), outputs, (model, data_dir, config))


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
