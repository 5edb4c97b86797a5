"""``qtool quantize``'s own options, each declared once, and the command's work on the record they fill."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import progress_bars, summary_console, write_json
from qtool.cli.groups import OptionGroup, filled
from qtool.cli.options import Calibration, OutputsOption, Sampling, Setup, Timing
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


@dataclass(frozen=True, kw_only=True)
class QuantizeInputs(OptionGroup):
    """What quantize reads: the model's setup, then statistics or samples."""

    setup: Setup = field(default_factory=Setup)
    stats: StatsOption = None
    data: QuantizeDataOption = None
    eval_data: QuantizeEvalDataOption = None


@dataclass(frozen=True, kw_only=True)
class Measured(OptionGroup):
    """Calibration, the samples both it and the comparison use, and the comparison's timing."""

    calibration: Calibration = field(default_factory=Calibration)
    sampling: Sampling = field(default_factory=Sampling)
    timing: Timing = field(default_factory=lambda: Timing(runs=20, warmup=3))


@dataclass(frozen=True, kw_only=True)
class Search(OptionGroup):
    """The sensitivity search and the measured placement choice; --no-search skips both."""

    target_sqnr_db: QuantizeTargetSqnrOption = None
    max_float_nodes: MaxFloatNodesOption = None
    data_dir: SearchDataOption = None
    search_seconds: SearchSecondsOption = None
    latency_runs: LatencyRunsOption = None
    outputs: OutputsOption = None
    no_search: NoSearchOption = False

    def options(self) -> SearchOptions | None:
        """The record, or None with --no-search."""
        return None if self.no_search else filled(SearchOptions, self, outputs=tuple(self.outputs or ()))


@dataclass(frozen=True, kw_only=True)
class Written(OptionGroup):
    """How the model is written."""

    external_data: ExternalDataOption = None
    opset: OpsetOption = None

    def options(self) -> OutputOptions:
        """The record."""
        return filled(OutputOptions, self)


def quantize_action(
    model: Path,
    output: Path,
    inputs: QuantizeInputs,
    measured: Measured,
    search: Search,
    vs_onnxruntime: bool,
    written: Written,
    json_out: str | None,
) -> None:
    """Quantize, write the model, report (and compare, with data)."""
    from qtool.api import quantize as run_quantize
    from qtool.reports.documents import quantize_to_dict, to_json
    from qtool.reports.tables import render_quantize

    with progress_bars() as progress:
        result = run_quantize(
            model,
            output,
            config_path=inputs.setup.config,
            target=inputs.setup.target,
            input_shapes=inputs.setup.shapes(),
            stats_path=inputs.stats,
            data_dir=inputs.data,
            eval_dir=inputs.eval_data,
            calibration=measured.calibration.options(measured.sampling),
            search=search.options(),
            evaluation=measured.timing.options(measured.sampling),
            output=written.options(),
            progress=progress,
            vs_onnxruntime=vs_onnxruntime,
        )
    render_quantize(summary_console(json_out), result)
    if json_out:
        write_json(json_out, to_json(quantize_to_dict(result)))
