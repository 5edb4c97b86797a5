"""``qtool quantize`` and ``qtool inspect``: the model rewritten, or what the rewrite would do."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, summary_console, write_json
from qtool.cli.groups import option_groups
from qtool.cli.options import JsonOption, ModelArgument, Setup
from qtool.cli.quantize_options import (
    Measured,
    QuantizeInputs,
    QuantizeOutputOption,
    Search,
    VsOnnxruntimeOption,
    Written,
    quantize_action,
)
from qtool.cli.run import run_command


@app.command()
@option_groups
def quantize(
    model: ModelArgument,
    output: QuantizeOutputOption,
    *,
    inputs: QuantizeInputs,
    measured: Measured,
    search: Search,
    vs_onnxruntime: VsOnnxruntimeOption = False,
    written: Written,
    json_out: JsonOption = None,
) -> None:
    """Quantize MODEL to int8 QDQ using --stats or --data, and write it to -o OUT.onnx.

    Without either, a config that needs no statistics still works: weights stored quantized
    (weight_only, fp16, placement: storage) or mode: dynamic.
    """
    run_command(
        partial(quantize_action, model, output, inputs, measured, search, vs_onnxruntime, written, json_out),
        {"-o": output, "--json": json_out},
        (model, inputs.setup.config, inputs.stats, inputs.data, search.data_dir, inputs.eval_data),
    )


@app.command()
@option_groups
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model.", show_default=False, metavar="MODEL")],
    setup: Setup,
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
        from qtool.reports.documents import inspection_to_dict, to_json
        from qtool.reports.tables import render_inspection

        result = run_inspect(
            model, config_path=setup.config, data_dir=data, target=setup.target, input_shapes=setup.shapes()
        )
        render_inspection(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(inspection_to_dict(result)))

    run_command(action, {"--json": json_out}, (model, setup.config, data))
