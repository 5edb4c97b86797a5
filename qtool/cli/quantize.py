"""``qtool quantize`` and ``qtool inspect``: the model rewritten, or what the rewrite would do."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, parse_observer_options, progress_bars, summary_console, write_json
from qtool.cli.options import (
    BatchOption,
    ConfigOption,
    InputShapesOption,
    JsonOption,
    LimitOption,
    ObserverOption,
    ObserverOptionsOption,
    OutputsOption,
    RunsOption,
    SkipNonfiniteOption,
    TargetOption,
    ThreadsOption,
    WarmupOption,
)
from qtool.cli.run import run_command
from qtool.options import CalibrationOptions, EvaluationOptions, OutputOptions, SearchOptions


@app.command()
def quantize(
    model: Annotated[Path, typer.Argument(help="Float ONNX model.", show_default=False, metavar="MODEL")],
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="PATH", help="Quantized ONNX model to write (never the input).")
    ],
    config: ConfigOption = None,
    input_shapes: InputShapesOption = None,
    target: TargetOption = None,
    stats: Annotated[
        Path | None, typer.Option("--stats", metavar="STATS.json", help="Statistics from 'qtool calibrate'.")
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            metavar="DATA_DIR",
            help="Calibrate on this directory (or fsspec URL) now (instead of --stats), "
            "then compare the result with the float model on it.",
        ),
    ] = None,
    eval_data: Annotated[
        str | None,
        typer.Option(
            "--eval",
            metavar="DATA_DIR",
            help="Held-out samples (directory or fsspec URL) to compare the result on; without it, "
            "the calibration samples are scored, with a warning.",
        ),
    ] = None,
    observer: ObserverOption = None,
    observer_option: ObserverOptionsOption = None,
    batch_size: BatchOption = None,
    limit: LimitOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    runs: RunsOption = 20,
    warmup: WarmupOption = 3,
    threads: ThreadsOption = None,
    target_sqnr: Annotated[
        float | None,
        typer.Option(
            "--target-sqnr",
            metavar="DB",
            help="Sensitivity search target in dB (default: the config's accuracy.target_sqnr_db, 30): "
            "the integer nodes that hurt most get float activations until the outputs reach it.",
        ),
    ] = None,
    max_float_nodes: Annotated[
        int | None,
        typer.Option(
            "--max-float-nodes",
            metavar="N",
            help="At most this many nodes moved by the search (float activations; entirely float when even "
            "storage-only misses the target).",
        ),
    ] = None,
    search_data: Annotated[
        str | None,
        typer.Option(
            "--search-data",
            metavar="DATA_DIR",
            help="Samples for the sensitivity search (default: --data; needed with --stats).",
        ),
    ] = None,
    search_seconds: Annotated[
        float | None,
        typer.Option(
            "--search-seconds",
            metavar="S",
            help="The sensitivity search tries no new node after S seconds (default: accuracy.search_seconds, 60).",
        ),
    ] = None,
    latency_runs: Annotated[
        int | None,
        typer.Option(
            "--latency-runs",
            metavar="N",
            help="Timing rounds per candidate placement (default: accuracy.latency_runs, 9; 0: no timing, "
            "the config's placement rules decide).",
        ),
    ] = None,
    outputs: OutputsOption = None,
    no_search: Annotated[
        bool,
        typer.Option(
            "--no-search",
            help="Skip the measured placement choice and the sensitivity search: the config's rules decide.",
        ),
    ] = False,
    external_data: Annotated[
        bool | None,
        typer.Option(
            "--external-data/--embed-data",
            help="Write the weights to OUT.onnx.<digest>.data beside the model, or embed them "
            "(default: embed, unless the model would exceed protobuf's 2 GiB limit).",
            show_default=False,
        ),
    ] = None,
    opset: Annotated[
        int | None,
        typer.Option(
            "--opset",
            metavar="N",
            min=1,
            help="Default-domain opset of the output (default: the model's, raised to what the config needs and "
            "lowered to the newest at which onnxruntime has QuantizeLinear/DequantizeLinear kernels).",
            show_default=False,
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Quantize MODEL to int8 QDQ using --stats or --data, and write it to -o OUT.onnx.

    Without either, a config that needs no statistics still works: weights stored quantized
    (weight_only, fp16, placement: storage) or mode: dynamic.
    """

    def action() -> None:
        from qtool.api import quantize as run_quantize
        from qtool.graph.input_shapes import parse_input_shapes
        from qtool.reports.documents import quantize_to_dict, to_json
        from qtool.reports.tables import render_quantize

        with progress_bars() as progress:
            result = run_quantize(
                model,
                output,
                config_path=config,
                target=target,
                input_shapes=parse_input_shapes(input_shapes) if input_shapes else None,
                stats_path=stats,
                data_dir=data,
                eval_dir=eval_data,
                calibration=CalibrationOptions(
                    observer=observer,
                    observer_options=parse_observer_options(observer_option),
                    batch_size=batch_size,
                    limit=limit,
                    skip_nonfinite=skip_nonfinite,
                ),
                search=None
                if no_search
                else SearchOptions(
                    target_sqnr_db=target_sqnr,
                    max_float_nodes=max_float_nodes,
                    data_dir=search_data,
                    search_seconds=search_seconds,
                    latency_runs=latency_runs,
                    outputs=tuple(outputs or ()),
                ),
                evaluation=EvaluationOptions(
                    runs=runs, warmup=warmup, threads=threads, limit=limit, skip_nonfinite=skip_nonfinite
                ),
                output=OutputOptions(external_data=external_data, opset=opset),
                progress=progress,
            )
        render_quantize(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(quantize_to_dict(result)))

    run_command(action, {"-o": output, "--json": json_out}, (model, config, stats, data, search_data, eval_data))


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model.", show_default=False, metavar="MODEL")],
    config: ConfigOption = None,
    input_shapes: InputShapesOption = None,
    target: TargetOption = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            metavar="DATA_DIR",
            help="Sample directory: its first calibration batch sizes the tensors that dynamic shapes "
            "leave open, per sample as quantize counts them, so placement 'auto' decides exactly as quantize will.",
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Show what quantize would do: every node's scheme and the rule behind it, sizes, and what stays float."""

    def action() -> None:
        from qtool.api import inspect as run_inspect
        from qtool.graph.input_shapes import parse_input_shapes
        from qtool.reports.documents import inspection_to_dict, to_json
        from qtool.reports.tables import render_inspection

        shapes = parse_input_shapes(input_shapes) if input_shapes else None
        result = run_inspect(model, config_path=config, data_dir=data, target=target, input_shapes=shapes)
        render_inspection(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(inspection_to_dict(result)))

    run_command(action, {"--json": json_out}, (model, config, data))
