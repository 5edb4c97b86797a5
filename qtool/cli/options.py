"""Options several commands share, each with its help text and placeholder, and the option groups they form."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from qtool.cli.groups import OptionGroup, filled
from qtool.options import CalibrationOptions, EvaluationOptions

ModelArgument = Annotated[Path, typer.Argument(help="Float ONNX model.", show_default=False, metavar="MODEL")]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        metavar="CONFIG.yaml",
        help="QConfigDict YAML, or the name of an installed one (qtool configs lists them: accurate, integer, "
        "dynamic, ...); merged over the built-in configs/default.yaml.",
    ),
]
OutputsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--outputs",
        metavar="NAME",
        help="An output the accuracy target judges, by name or re:pattern; repeat for several "
        "(default: accuracy.outputs, else every output but the state a model feeds back).",
    ),
]
GateOutputsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--outputs",
        metavar="NAME",
        help="An output the error gates (--fail-under sqnr=/cosine=, --fail-over mse=/max_abs_error=) judge, by "
        "name or re:pattern; repeat for several (default: the config's accuracy.outputs, else every output but "
        "the state a streaming model feeds back). Every output is still reported.",
    ),
]
InputShapesOption = Annotated[
    str | None,
    typer.Option(
        "--input-shapes",
        metavar="SHAPES",
        help="NAME:AxBx...[,...]: fix inputs' dynamic dimensions other than batch (images:1x3x640x640): sizes are "
        "known without data, and samples of another shape are refused.",
    ),
]
TargetOption = Annotated[
    str | None,
    typer.Option(
        "--target",
        metavar="TARGET",
        help="cpu, cpu_vnni, cuda or tensorrt: whose rules the model follows (overrides the config's 'target:'). "
        "cpu: portable x86 / ARM; cpu_vnni: x86 with VNNI or ARM only (full-range int8 weights, no saturation "
        "guard); tensorrt: symmetric int8 activations, Q/DQ on both inputs of every weighted op and residual Add.",
    ),
]
ObserverOption = Annotated[
    str | None,
    typer.Option(
        "--observer",
        metavar="NAME",
        help="Observer for activation ranges (default: calibration.observer of the config, mse).",
    ),
]
ShardOption = Annotated[
    str | None,
    typer.Option(
        "--shard",
        metavar="K/N",
        help="Process only shard K/N of the samples (every N-th file from the K-th); merge the "
        "shards' statistics with 'qtool merge'.",
    ),
]


class DataLocation(str):
    """A sample folder or an fsspec URL, kept as typed (a Path would fold a URL's ``//``)."""


DataLocation.__name__ = "folder|url"  # what --help shows for it: <folder|url>

WorkersOption = Annotated[
    int | None,
    typer.Option(
        "--workers",
        metavar="N",
        min=1,
        max=1024,
        help="Spread the samples over N local Dask worker processes (one onnxruntime thread each); "
        "the merged statistics equal one process's. Needs the 'distributed' extra.",
    ),
]
SchedulerOption = Annotated[
    str | None,
    typer.Option(
        "--scheduler",
        metavar="ADDRESS",
        help="Spread the samples over the workers of a running Dask scheduler (e.g. tcp://host:8786); "
        "model, data and config paths must be readable on every worker.",
    ),
]
SkipNonfiniteOption = Annotated[
    bool,
    typer.Option(
        "--skip-nonfinite", help="Skip samples holding NaN or Inf (counted in the summary) instead of failing."
    ),
]
ObserverOptionsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--observer-option",
        metavar="KEY=VALUE",
        help="Observer option KEY=VALUE, repeatable (e.g. percentile=99.9, bins=4096); see 'qtool observers'.",
    ),
]
BatchOption = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        metavar="N",
        min=1,
        help="Samples per inference when the batch dimension is dynamic (default: calibration.batch_size).",
    ),
]
LimitOption = Annotated[
    int | None, typer.Option("--limit", metavar="N", min=1, help="Use only the first N samples (sorted by file name).")
]
JsonOption = Annotated[
    str | None,
    typer.Option(
        "--json",
        metavar="PATH|-",
        help="Also write the result as JSON to PATH, or '-' for stdout (tables then go to stderr).",
    ),
]
RunsOption = Annotated[
    int, typer.Option("--runs", metavar="N", min=0, help="Timed runs per model for latency (0 skips latency).")
]
WarmupOption = Annotated[int, typer.Option("--warmup", metavar="N", min=0, help="Untimed warm-up runs per model.")]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads", metavar="N", min=1, max=4096, help="onnxruntime intra-op threads (default: onnxruntime's choice)."
    ),
]


@dataclass(frozen=True, kw_only=True)
class Setup(OptionGroup):
    """The model's config, input shapes and target: calibrate and quantize."""

    config: ConfigOption = None
    input_shapes: InputShapesOption = None
    target: TargetOption = None

    def shapes(self) -> dict[str, tuple[int, ...]] | None:
        """--input-shapes parsed (None when not given)."""
        return parsed_shapes(self.input_shapes)


@dataclass(frozen=True, kw_only=True)
class Sampling(OptionGroup):
    """Which samples count: calibration and evaluation share it."""

    limit: LimitOption = None
    skip_nonfinite: SkipNonfiniteOption = False


@dataclass(frozen=True, kw_only=True)
class Calibration(OptionGroup):
    """The observer and its batches: calibrate and quantize."""

    observer: ObserverOption = None
    observer_option: ObserverOptionsOption = None
    batch_size: BatchOption = None

    def options(self, *more: OptionGroup, **own: Any) -> CalibrationOptions:
        """The record, with the fields of ``more`` groups (sampling, ...) and the command's ``own``."""
        from qtool.cli.app import parse_observer_options

        return filled(
            CalibrationOptions, self, *more, **own, observer_options=parse_observer_options(self.observer_option)
        )


@dataclass(frozen=True, kw_only=True)
class Timing(OptionGroup):
    """Latency runs and threads (defaults: compare's; quantize sets its own)."""

    runs: RunsOption = 50
    warmup: WarmupOption = 5
    threads: ThreadsOption = None

    def options(self, *more: OptionGroup, **own: Any) -> EvaluationOptions:
        """The record, with the fields of ``more`` groups (sampling, ...) and the command's ``own``."""
        return filled(EvaluationOptions, self, *more, **own)


def parsed_shapes(text: str | None) -> dict[str, tuple[int, ...]] | None:
    """--input-shapes parsed (None when not given)."""
    from qtool.graph.input_shapes import parse_input_shapes

    return parse_input_shapes(text) if text else None
