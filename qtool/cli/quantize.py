"""``qtool quantize`` and ``qtool inspect``: the model rewritten, or what the rewrite would do."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, summary_console, write_json
from qtool.cli.options import (
    BatchOption,
    ConfigOption,
    InputShapesOption,
    JsonOption,
    LimitOption,
    ModelArgument,
    ObserverOption,
    ObserverOptionsOption,
    OutputsOption,
    RunsOption,
    SkipNonfiniteOption,
    TargetOption,
    ThreadsOption,
    WarmupOption,
)
from qtool.cli.quantize_options import (
    ExternalDataOption,
    LatencyRunsOption,
    MaxFloatNodesOption,
    NoSearchOption,
    OpsetOption,
    QuantizeArgs,
    QuantizeDataOption,
    QuantizeEvalDataOption,
    QuantizeOutputOption,
    QuantizeTargetSqnrOption,
    SearchDataOption,
    SearchSecondsOption,
    StatsOption,
    VsOnnxruntimeOption,
    quantize_action,
)
from qtool.cli.run import run_command


@app.command()
def quantize(
    model: ModelArgument,
    output: QuantizeOutputOption,
    config: ConfigOption = None,
    input_shapes: InputShapesOption = None,
    target: TargetOption = None,
    stats: StatsOption = None,
    data: QuantizeDataOption = None,
    eval_data: QuantizeEvalDataOption = None,
    observer: ObserverOption = None,
    observer_option: ObserverOptionsOption = None,
    batch_size: BatchOption = None,
    limit: LimitOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    runs: RunsOption = 20,
    warmup: WarmupOption = 3,
    threads: ThreadsOption = None,
    target_sqnr: QuantizeTargetSqnrOption = None,
    max_float_nodes: MaxFloatNodesOption = None,
    search_data: SearchDataOption = None,
    search_seconds: SearchSecondsOption = None,
    latency_runs: LatencyRunsOption = None,
    outputs: OutputsOption = None,
    no_search: NoSearchOption = False,
    vs_onnxruntime: VsOnnxruntimeOption = False,
    external_data: ExternalDataOption = None,
    opset: OpsetOption = None,
    json_out: JsonOption = None,
) -> None:
    """Quantize MODEL to int8 QDQ using --stats or --data, and write it to -o OUT.onnx.

    Without either, a config that needs no statistics still works: weights stored quantized
    (weight_only, fp16, placement: storage) or mode: dynamic.
    """
    args = QuantizeArgs(**locals())

    run_command(
        partial(quantize_action, args),
        {"-o": output, "--json": json_out},
        (model, config, stats, data, search_data, eval_data),
    )


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
