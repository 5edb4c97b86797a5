"""``qtool calibrate`` and ``qtool merge``: statistics in, statistics out."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, summary_console, write_json
from qtool.cli.calibrate_options import (
    CalibrateOutputOption,
    Calibrating,
    DataDirArgument,
    TensorrtCache,
    calibrate_action,
)
from qtool.cli.groups import option_groups
from qtool.cli.options import JsonOption, ModelArgument, Setup
from qtool.cli.run import run_command


@app.command()
@option_groups
def calibrate(
    model: ModelArgument,
    data_dir: DataDirArgument,
    output: CalibrateOutputOption,
    *,
    setup: Setup,
    calibrating: Calibrating,
    tensorrt: TensorrtCache,
    json_out: JsonOption = None,
) -> None:
    """Run the float model over DATA_DIR and write activation statistics to -o STATS.json."""
    action = partial(calibrate_action, model, data_dir, output, setup, calibrating, tensorrt, json_out)
    outputs = {"-o": output, "--json": json_out, "--tensorrt-cache": tensorrt.tensorrt_cache}
    run_command(action, outputs, (model, data_dir, setup.config))


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
