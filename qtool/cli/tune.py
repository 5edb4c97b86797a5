"""``qtool tune``: the smallest (or fastest) model that meets an accuracy budget, and its config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, progress_bars, summary_console, write_json
from qtool.cli.options import (
    ConfigOption,
    InputShapesOption,
    JsonOption,
    OutputsOption,
    TargetOption,
    ThreadsOption,
)
from qtool.cli.run import run_command
from qtool.options import DECODE_STEPS, TuneOptions


@app.command()
def tune(
    model: Annotated[Path, typer.Argument(help="Float ONNX model.", show_default=False, metavar="MODEL")],
    data: Annotated[
        str, typer.Option("--data", metavar="CALIB", help="Calibration samples (directory or fsspec URL).")
    ],
    eval_data: Annotated[
        str,
        typer.Option(
            "--eval",
            metavar="EVAL",
            help="Held-out samples (directory or URL), split in two halves matched on the float outputs: one "
            "selects the model, the other validates the choice (the promise is judged only on those).",
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="OUT.onnx", help="The chosen model.")],
    config_out: Annotated[
        Path,
        typer.Option(
            "--config-out",
            metavar="CHOSEN.yaml",
            help="The QConfigDict that reproduces OUT.onnx byte for byte: qtool quantize --config CHOSEN.yaml "
            "--data CALIB.",
        ),
    ],
    target_sqnr: Annotated[
        float | None,
        typer.Option(
            "--target-sqnr",
            metavar="DB",
            help="The worst output's SQNR must reach DB on the validation samples, at --confidence.",
        ),
    ] = None,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            metavar="MODULE:FUNCTION",
            help="Your task metric instead of SQNR: called per EVAL sample with the float and the candidate "
            "outputs (dicts of arrays; and the label with --labels), averaged.",
        ),
    ] = None,
    target_metric: Annotated[
        float | None,
        typer.Option("--target-metric", metavar="X", help="The mean --metric must reach X."),
    ] = None,
    lower_is_better: Annotated[
        bool, typer.Option("--lower-is-better", help="The --metric is an error: stay at or below --target-metric.")
    ] = False,
    target_decode: Annotated[
        float | None,
        typer.Option(
            "--target-decode",
            metavar="SHARE",
            help="Decoders: instead of SQNR, the share of greedy tokens a candidate generates as the float model "
            "does (free-running, --decode-steps per EVAL token file, through its own cache) must reach SHARE "
            "(e.g. 0.9), at --confidence.",
        ),
    ] = None,
    decode_steps: Annotated[
        int,
        typer.Option("--decode-steps", metavar="N", help="Greedy steps per EVAL token file for --target-decode."),
    ] = DECODE_STEPS,
    labels: Annotated[
        Path | None,
        typer.Option(
            "--labels", metavar="FILE", help="One label per EVAL sample in sorted order (.npy, or text lines)."
        ),
    ] = None,
    max_latency_ratio: Annotated[
        float | None,
        typer.Option(
            "--max-latency-ratio",
            metavar="R",
            help="Only models at most R x the float model's time (CPU, interleaved, 99 % interval).",
        ),
    ] = None,
    objective: Annotated[
        str,
        typer.Option("--objective", metavar="size|latency", help="What to minimise among the models that qualify."),
    ] = "size",
    time_budget: Annotated[
        float,
        typer.Option(
            "--time-budget",
            metavar="SECONDS",
            help="Stop searching after this long and keep the best model so far (the report says so).",
        ),
    ] = 600.0,
    sensitivity_samples: Annotated[
        int,
        typer.Option(
            "--sensitivity-samples",
            metavar="N",
            help="Selection samples each node is measured on, spread over them (all when there are fewer).",
        ),
    ] = 8,
    confidence: Annotated[
        float,
        typer.Option(
            "--confidence",
            metavar="P",
            help="One-sided confidence of the promise: the lower bound, from the per-sample spread, that the "
            "figure on a new set of as many samples reaches with probability P.",
        ),
    ] = 0.9,
    config: ConfigOption = None,
    target: TargetOption = None,
    input_shapes: InputShapesOption = None,
    threads: ThreadsOption = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot", metavar="PATH.png", help="Draw what was tried: size against accuracy (needs matplotlib)."
        ),
    ] = None,
    json_out: JsonOption = None,
    cache: Annotated[
        bool,
        typer.Option(
            "--cache/--no-cache",
            help="Keep the per-node sensitivity measurement and reuse it when model, config, data, options "
            "and versions are the same (default: on).",
        ),
    ] = True,
    outputs: OutputsOption = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            metavar="DIR",
            help="Where the measurements are kept (default: $QTOOL_CACHE_DIR, else $XDG_CACHE_HOME/qtool, "
            "else ~/.cache/qtool).",
        ),
    ] = None,
) -> None:
    """Find the smallest model (or the fastest) that meets an accuracy budget; write it and its config.

    EVAL is split in two. On the selection half, every node with a weight is measured alone at each
    precision its target allows (int2/int4/int8 weights, GPTQ or nearest rounding, int8/int16/float
    activations, fp16, float); precisions are then allocated for a noise budget and each allocation is
    built and verified, moving the budget until the best is found. The validation half scores the
    choice: the promise is the lower confidence bound of that figure. Exit 1 when no model meets it.
    """

    def action() -> None:
        from qtool.api import tune as run_tune
        from qtool.graph.input_shapes import parse_input_shapes
        from qtool.reports.documents import to_json
        from qtool.reports.tuning import render_tune, tune_to_dict

        if plot is not None:
            from qtool.reports.plot import require_matplotlib

            require_matplotlib()
        with progress_bars() as progress:
            result = run_tune(
                model,
                output,
                config_out,
                data_dir=data,
                eval_dir=eval_data,
                options=TuneOptions(
                    target_sqnr_db=target_sqnr,
                    metric=metric,
                    target_metric=target_metric,
                    lower_is_better=lower_is_better,
                    labels=labels,
                    target_decode=target_decode,
                    decode_steps=decode_steps,
                    max_latency_ratio=max_latency_ratio,
                    objective=objective,
                    time_budget=time_budget,
                    sensitivity_samples=sensitivity_samples,
                    confidence=confidence,
                    threads=threads,
                    cache=cache,
                    cache_dir=cache_dir,
                    outputs=tuple(outputs or ()),
                ),
                config_path=config,
                target=target,
                input_shapes=parse_input_shapes(input_shapes) if input_shapes else None,
                progress=progress,
            )
        render_tune(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(tune_to_dict(result)))
        if plot is not None:
            from qtool.reports.tuning import plot_trials

            plot_trials(result, plot)
        if not result.met:
            from qtool.errors import CheckFailedError
            from qtool.reports.tuning import missed_line

            raise CheckFailedError(missed_line(result))

    run_command(
        action,
        {"-o": output, "--config-out": config_out, "--json": json_out, "--plot": plot},
        (model, config, data, eval_data, labels),
    )
