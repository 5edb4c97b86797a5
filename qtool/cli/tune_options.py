"""``qtool tune``'s own options, each declared once, and the command's work on the record they fill."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import progress_bars, summary_console, write_json
from qtool.cli.groups import OptionGroup, filled
from qtool.cli.options import OutputsOption, ThreadsOption, parsed_shapes
from qtool.options import DECODE_STEPS, TuneOptions

TuneDataOption = Annotated[
    str, typer.Option("--data", metavar="CALIB", help="Calibration samples (directory or fsspec URL).")
]
TuneEvalDataOption = Annotated[
    str,
    typer.Option(
        "--eval",
        metavar="EVAL",
        help="Held-out samples (directory or URL), split in two halves matched on the float outputs: one "
        "selects the model, the other validates the choice (the promise is judged only on those).",
    ),
]
TuneOutputOption = Annotated[Path, typer.Option("--output", "-o", metavar="OUT.onnx", help="The chosen model.")]
ConfigOutOption = Annotated[
    Path,
    typer.Option(
        "--config-out",
        metavar="CHOSEN.yaml",
        help="The QConfigDict that reproduces OUT.onnx byte for byte: qtool quantize --config CHOSEN.yaml "
        "--data CALIB.",
    ),
]
TuneTargetSqnrOption = Annotated[
    float | None,
    typer.Option(
        "--target-sqnr",
        metavar="DB",
        help="The worst output's SQNR must reach DB on the validation samples, at --confidence.",
    ),
]
MetricOption = Annotated[
    str | None,
    typer.Option(
        "--metric",
        metavar="MODULE:FUNCTION",
        help="Your task metric instead of SQNR: called per EVAL sample with the float and the candidate "
        "outputs (dicts of arrays; and the label with --labels), averaged.",
    ),
]
TargetMetricOption = Annotated[
    float | None,
    typer.Option("--target-metric", metavar="X", help="The mean --metric must reach X."),
]
LowerIsBetterOption = Annotated[
    bool, typer.Option("--lower-is-better", help="The --metric is an error: stay at or below --target-metric.")
]
TargetDecodeOption = Annotated[
    float | None,
    typer.Option(
        "--target-decode",
        metavar="SHARE",
        help="Decoders: instead of SQNR, the share of greedy tokens a candidate generates as the float model "
        "does (free-running, --decode-steps per EVAL token file, through its own cache) must reach SHARE "
        "(e.g. 0.9), at --confidence.",
    ),
]
TuneDecodeStepsOption = Annotated[
    int,
    typer.Option("--decode-steps", metavar="N", help="Greedy steps per EVAL token file for --target-decode."),
]
LabelsOption = Annotated[
    Path | None,
    typer.Option("--labels", metavar="FILE", help="One label per EVAL sample in sorted order (.npy, or text lines)."),
]
TuneMaxLatencyRatioOption = Annotated[
    float | None,
    typer.Option(
        "--max-latency-ratio",
        metavar="R",
        help="Only models at most R x the float model's time (CPU, interleaved, 99 % interval).",
    ),
]
ObjectiveOption = Annotated[
    str,
    typer.Option("--objective", metavar="size|latency", help="What to minimise among the models that qualify."),
]
TimeBudgetOption = Annotated[
    float,
    typer.Option(
        "--time-budget",
        metavar="SECONDS",
        help="Stop searching after this long and keep the best model so far (the report says so).",
    ),
]
SensitivitySamplesOption = Annotated[
    int,
    typer.Option(
        "--sensitivity-samples",
        metavar="N",
        help="Selection samples each node is measured on, spread over them (all when there are fewer).",
    ),
]
ConfidenceOption = Annotated[
    float,
    typer.Option(
        "--confidence",
        metavar="P",
        help="One-sided confidence of the promise: the lower bound, from the per-sample spread, that the "
        "figure on a new set of as many samples reaches with probability P.",
    ),
]
TunePlotOption = Annotated[
    Path | None,
    typer.Option("--plot", metavar="PATH.png", help="Draw what was tried: size against accuracy (needs matplotlib)."),
]
CacheOption = Annotated[
    bool,
    typer.Option(
        "--cache/--no-cache",
        help="Keep the per-node sensitivity measurement and reuse it when model, config, data, options "
        "and versions are the same (default: on).",
    ),
]
CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        metavar="DIR",
        help="Where the measurements are kept (default: $QTOOL_CACHE_DIR, else $XDG_CACHE_HOME/qtool, "
        "else ~/.cache/qtool).",
    ),
]


@dataclass(frozen=True, kw_only=True)
class TuneData(OptionGroup):
    """The calibration samples and the held-out ones."""

    data: TuneDataOption
    eval_data: TuneEvalDataOption


@dataclass(frozen=True, kw_only=True)
class TuneWritten(OptionGroup):
    """The chosen model, its config, and the plot asked for."""

    output: TuneOutputOption
    config_out: ConfigOutOption
    plot: TunePlotOption = None


@dataclass(frozen=True, kw_only=True)
class TuneSearch(OptionGroup):
    """The accuracy budget, what is minimised, and how the search runs."""

    target_sqnr_db: TuneTargetSqnrOption = None
    metric: MetricOption = None
    target_metric: TargetMetricOption = None
    lower_is_better: LowerIsBetterOption = False
    target_decode: TargetDecodeOption = None
    decode_steps: TuneDecodeStepsOption = DECODE_STEPS
    labels: LabelsOption = None
    max_latency_ratio: TuneMaxLatencyRatioOption = None
    objective: ObjectiveOption = "size"
    time_budget: TimeBudgetOption = 600.0
    sensitivity_samples: SensitivitySamplesOption = 8
    confidence: ConfidenceOption = 0.9
    threads: ThreadsOption = None
    cache: CacheOption = True
    outputs: OutputsOption = None
    cache_dir: CacheDirOption = None

    def options(self) -> TuneOptions:
        """The record."""
        return filled(TuneOptions, self, outputs=tuple(self.outputs or ()))


def tune_action(
    model: Path,
    data: TuneData,
    written: TuneWritten,
    search: TuneSearch,
    config: Path | None,
    target: str | None,
    input_shapes: str | None,
    json_out: str | None,
) -> None:
    """Tune, write the model and its config, report."""
    from qtool.api import tune as run_tune
    from qtool.reports.documents import to_json
    from qtool.reports.tuning import render_tune, tune_to_dict

    if written.plot is not None:
        from qtool.reports.plot import require_matplotlib

        require_matplotlib()
    with progress_bars() as progress:
        result = run_tune(
            model,
            written.output,
            written.config_out,
            data_dir=data.data,
            eval_dir=data.eval_data,
            options=search.options(),
            config_path=config,
            target=target,
            input_shapes=parsed_shapes(input_shapes),
            progress=progress,
        )
    render_tune(summary_console(json_out), result)
    if json_out:
        write_json(json_out, to_json(tune_to_dict(result)))
    if written.plot is not None:
        from qtool.reports.tuning import plot_trials

        plot_trials(result, written.plot)
    if not result.met:
        from qtool.errors import CheckFailedError
        from qtool.reports.tuning import missed_line

        raise CheckFailedError(missed_line(result))
