"""``qtool quantize``'s own options, each declared once, and the command's work on the record they fill."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import progress_bars, summary_console, write_json
from qtool.cli.options import calibration_options, evaluation_options
from qtool.options import OutputOptions, SearchOptions

QuantizeOutputOption = Annotated[
    Path, typer.Option("--output", "-o", metavar="PATH", help="Quantized ONNX model to write (never the input).")
]
StatsOption = Annotated[
    Path | None, typer.Option("--stats", metavar="STATS.json", help="Statistics from 'qtool calibrate'.")
]
QuantizeDataOption = Annotated[
    str | None,
    typer.Option(
        "--data",
        metavar="DATA_DIR",
        help="Calibrate on this directory (or fsspec URL) now (instead of --stats), "
        "then compare the result with the float model on it.",
    ),
]
QuantizeEvalDataOption = Annotated[
    str | None,
    typer.Option(
        "--eval",
        metavar="DATA_DIR",
        help="Held-out samples (directory or fsspec URL) to compare the result on; without it, "
        "the calibration samples are scored, with a warning.",
    ),
]
QuantizeTargetSqnrOption = Annotated[
    float | None,
    typer.Option(
        "--target-sqnr",
        metavar="DB",
        help="Sensitivity search target in dB (default: the config's accuracy.target_sqnr_db, 30): "
        "the integer nodes that hurt most get float activations until the outputs reach it.",
    ),
]
MaxFloatNodesOption = Annotated[
    int | None,
    typer.Option(
        "--max-float-nodes",
        metavar="N",
        help="At most this many nodes moved by the search (float activations; entirely float when even "
        "storage-only misses the target).",
    ),
]
SearchDataOption = Annotated[
    str | None,
    typer.Option(
        "--search-data",
        metavar="DATA_DIR",
        help="Samples for the sensitivity search (default: --data; needed with --stats).",
    ),
]
SearchSecondsOption = Annotated[
    float | None,
    typer.Option(
        "--search-seconds",
        metavar="S",
        help="The sensitivity search tries no new node after S seconds (default: accuracy.search_seconds, 60).",
    ),
]
LatencyRunsOption = Annotated[
    int | None,
    typer.Option(
        "--latency-runs",
        metavar="N",
        help="Timing rounds per candidate placement (default: accuracy.latency_runs, 9; 0: no timing, "
        "the config's placement rules decide).",
    ),
]
NoSearchOption = Annotated[
    bool,
    typer.Option(
        "--no-search",
        help="Skip the measured placement choice and the sensitivity search: the config's rules decide.",
    ),
]
VsOnnxruntimeOption = Annotated[
    bool,
    typer.Option(
        "--vs-onnxruntime",
        help="Also quantize MODEL with onnxruntime's quantize_static (QDQ, MinMax, per-channel int8 weights, uint8 "
        "activations) on the --data samples, and report both models beside fp32: size, worst output SQNR on the "
        "compared samples, speed-up at 1 thread and at every core, timed interleaved in this run. Needs --data.",
    ),
]
ExternalDataOption = Annotated[
    bool | None,
    typer.Option(
        "--external-data/--embed-data",
        help="Write the weights to OUT.onnx.<digest>.data beside the model, or embed them "
        "(default: embed, unless the model would exceed protobuf's 2 GiB limit).",
        show_default=False,
    ),
]
OpsetOption = Annotated[
    int | None,
    typer.Option(
        "--opset",
        metavar="N",
        min=1,
        help="Default-domain opset of the output (default: the model's, raised to what the config needs and "
        "lowered to the newest at which onnxruntime has QuantizeLinear/DequantizeLinear kernels).",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class QuantizeArgs:
    """What ``qtool quantize`` was given, option by option."""

    model: Path
    output: Path
    config: Path | None
    input_shapes: str | None
    target: str | None
    stats: Path | None
    data: str | None
    eval_data: str | None
    observer: str | None
    observer_option: list[str] | None
    batch_size: int | None
    limit: int | None
    skip_nonfinite: bool
    runs: int
    warmup: int
    threads: int | None
    target_sqnr: float | None
    max_float_nodes: int | None
    search_data: str | None
    search_seconds: float | None
    latency_runs: int | None
    outputs: list[str] | None
    no_search: bool
    vs_onnxruntime: bool
    external_data: bool | None
    opset: int | None
    json_out: str | None


def quantize_action(args: QuantizeArgs) -> None:
    """Quantize, write the model, report (and compare, with data)."""
    from qtool.api import quantize as run_quantize
    from qtool.graph.input_shapes import parse_input_shapes
    from qtool.reports.documents import quantize_to_dict, to_json
    from qtool.reports.tables import render_quantize

    with progress_bars() as progress:
        result = run_quantize(
            args.model,
            args.output,
            config_path=args.config,
            target=args.target,
            input_shapes=parse_input_shapes(args.input_shapes) if args.input_shapes else None,
            stats_path=args.stats,
            data_dir=args.data,
            eval_dir=args.eval_data,
            calibration=calibration_options(args),
            search=None
            if args.no_search
            else SearchOptions(
                target_sqnr_db=args.target_sqnr,
                max_float_nodes=args.max_float_nodes,
                data_dir=args.search_data,
                search_seconds=args.search_seconds,
                latency_runs=args.latency_runs,
                outputs=tuple(args.outputs or ()),
            ),
            evaluation=evaluation_options(args),
            output=OutputOptions(external_data=args.external_data, opset=args.opset),
            progress=progress,
            vs_onnxruntime=args.vs_onnxruntime,
        )
    render_quantize(summary_console(args.json_out), result)
    if args.json_out:
        write_json(args.json_out, to_json(quantize_to_dict(result)))
