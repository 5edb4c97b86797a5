"""``qtool compare``'s options, each declared once, and the command's work on the record they fill."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qtool.cli.app import progress_bars, summary_console, write_json
from qtool.cli.groups import OptionGroup
from qtool.cli.options import GateOutputsOption, InputShapesOption, JsonOption, Sampling, Timing, parsed_shapes
from qtool.errors import CheckFailedError, QtoolError
from qtool.options import DECODE_STEPS

if TYPE_CHECKING:
    from qtool.evaluation.gates import Gate
    from qtool.options import EvaluationOptions
    from qtool.results import ComparisonResult

ReferenceArgument = Annotated[
    Path, typer.Argument(help="Reference (float) ONNX model.", show_default=False, metavar="REFERENCE")
]
CandidateArgument = Annotated[
    Path, typer.Argument(help="Candidate (quantized) ONNX model.", show_default=False, metavar="CANDIDATE")
]
EvalDataOption = Annotated[
    str, typer.Option("--data", metavar="DATA_DIR", help="Directory (or fsspec URL) of evaluation samples.")
]
PreprocessConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", metavar="CONFIG.yaml", help="QConfigDict YAML whose preprocess: block reads images."
    ),
]
TaskOption = Annotated[
    str,
    typer.Option(
        "--task",
        metavar="TASK",
        help="auto: top-1/top-5 agreement for outputs that hold class scores (Softmax, logits heads, "
        "names; the report says why); classification: for every output; none.",
    ),
]
DecodeStepsOption = Annotated[
    int,
    typer.Option(
        "--decode-steps",
        metavar="N",
        help="Decoders (a key/value cache): tokens each sample is continued greedily through the cache, "
        "scored step by step and free-running (0: perplexity and next-token agreement only).",
    ),
]
PerLayerOption = Annotated[
    bool, typer.Option("--per-layer", help="Pair every intermediate float tensor and report which layer hurts.")
]
PlotOption = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="PLOT.png",
        help="Draw per-layer SQNR to this PNG (implies --per-layer; needs qtool-onnx[plot]).",
    ),
]
ProvidersOption = Annotated[
    str,
    typer.Option(
        "--providers",
        metavar="LIST",
        help="Execution providers for latency, comma-separated: cpu, cuda, tensorrt "
        "or full onnxruntime names. Unavailable ones are reported as skipped.",
    ),
]
RequireProvidersOption = Annotated[
    bool,
    typer.Option(
        "--require-providers",
        help="Fail (exit 2, before any work) when a provider of --providers is not available, "
        "instead of reporting it as skipped: a misconfigured GPU runner cannot pass.",
    ),
]
TrtEngineCacheOption = Annotated[
    Path | None,
    typer.Option(
        "--trt-engine-cache",
        metavar="DIR",
        help="TensorRT: keep built engines in DIR, so later runs on the same models and shapes skip the build.",
    ),
]
MarkdownOption = Annotated[
    Path | None,
    typer.Option("--markdown", metavar="REPORT.md", help="Write a Markdown report (e.g. to $GITHUB_STEP_SUMMARY)."),
]
JunitOption = Annotated[
    Path | None, typer.Option("--junit", metavar="GATES.xml", help="Write the gates as JUnit XML test cases.")
]
FailUnderOption = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-under",
        metavar="METRIC=VALUE",
        help="Gate METRIC=VALUE that fails below VALUE: sqnr, cosine, top1, top5, box_iou, compression; "
        "decoders: next_token, decode_agreement, free_running. Repeatable.",
    ),
]
FailOverOption = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-over",
        metavar="METRIC=VALUE",
        help="Gate METRIC=VALUE that fails above VALUE: mse, max_abs_error, latency_ratio; "
        "decoders: ppl_ratio. Repeatable.",
    ),
]
MinCompressionOption = Annotated[
    float | None,
    typer.Option("--min-compression", metavar="RATIO", help="Gate: on-disk compression ratio must be at least this."),
]
MaxLatencyRatioOption = Annotated[
    float | None,
    typer.Option(
        "--max-latency-ratio",
        metavar="RATIO",
        help="Gate: candidate/reference latency on the first provider (median of paired rounds) must be "
        "at most this; it fails only when the 99 % interval lies wholly above.",
    ),
]
BaselineOption = Annotated[
    Path | None,
    typer.Option(
        "--baseline",
        metavar="REPORT.json",
        help="An earlier 'compare --json' report (e.g. from main): show the change in size, accuracy "
        "and latency against it in every report.",
    ),
]
FailOnRegressionOption = Annotated[
    bool,
    typer.Option(
        "--fail-on-regression",
        help="With --baseline: exit 1 when size, accuracy or latency got worse than the baseline "
        "beyond its tolerance (each becomes a gate).",
    ),
]
LatencyToleranceOption = Annotated[
    str | None,
    typer.Option(
        "--latency-tolerance",
        metavar="PCT",
        help="Slack on --max-latency-ratio, e.g. 5% (or 0.05): fail only above RATIO x (1 + PCT). "
        "Default 2%: sessions of one model differ by about 1%.",
    ),
]


@dataclass(frozen=True, kw_only=True)
class CompareInputs(OptionGroup):
    """The samples, and what reads them."""

    data: EvalDataOption
    config: PreprocessConfigOption = None
    input_shapes: InputShapesOption = None


@dataclass(frozen=True, kw_only=True)
class CompareEvaluation(OptionGroup):
    """What is measured, on which samples and providers, and how latency is timed."""

    sampling: Sampling = field(default_factory=Sampling)
    task: TaskOption = "auto"
    decode_steps: DecodeStepsOption = DECODE_STEPS
    per_layer: PerLayerOption = False
    plot: PlotOption = None
    providers: ProvidersOption = "cpu"
    require_providers: RequireProvidersOption = False
    trt_engine_cache: TrtEngineCacheOption = None
    timing: Timing = field(default_factory=Timing)

    def options(self, providers: list[str], outputs: list[str] | None) -> EvaluationOptions:
        """The record, for the checked ``providers`` and the gates' ``outputs``."""
        cache = self.trt_engine_cache
        return self.timing.options(
            self.sampling,
            self,
            per_layer=self.per_layer or self.plot is not None,
            providers=tuple(providers),
            trt_engine_cache=str(cache) if cache is not None else None,
            outputs=tuple(outputs or ()),
        )


@dataclass(frozen=True, kw_only=True)
class Reports(OptionGroup):
    """The report files (and JSON) asked for."""

    json_out: JsonOption = None
    markdown: MarkdownOption = None
    junit: JunitOption = None


@dataclass(frozen=True, kw_only=True)
class Gates(OptionGroup):
    """The gates, the baseline, and the outputs they judge."""

    fail_under: FailUnderOption = None
    fail_over: FailOverOption = None
    min_compression: MinCompressionOption = None
    max_latency_ratio: MaxLatencyRatioOption = None
    baseline: BaselineOption = None
    fail_on_regression: FailOnRegressionOption = False
    outputs: GateOutputsOption = None
    latency_tolerance: LatencyToleranceOption = None


def compare_action(
    reference: Path,
    candidate: Path,
    inputs: CompareInputs,
    evaluation: CompareEvaluation,
    reports: Reports,
    gates: Gates,
) -> None:
    """Check the options, compare, write the reports asked for; CheckFailedError when a gate fails."""
    from qtool.api import compare as run_compare

    judged, chosen = _checked(evaluation, gates)
    with progress_bars() as progress:
        result = run_compare(
            reference,
            candidate,
            inputs.data,
            options=evaluation.options(chosen, gates.outputs),
            config_path=inputs.config,
            gates=judged,
            progress=progress,
            input_shapes=parsed_shapes(inputs.input_shapes),
            baseline=gates.baseline,
            fail_on_regression=gates.fail_on_regression,
        )
    _reported(reports, evaluation.plot, result)
    if not result.gates_passed:
        failed = [g.gate for g in result.gates if not g.passed]
        raise CheckFailedError(f"{len(failed)} of {len(result.gates)} gates failed: {', '.join(failed)}")


def _checked(evaluation: CompareEvaluation, gates: Gates) -> tuple[list[Gate], list[str]]:
    """The gates and the providers, checked before any work (the TensorRT cache folder too)."""
    from qtool.evaluation.gates import check_measurable, parse_gates
    from qtool.evaluation.providers import parse_providers, require_available

    judged = parse_gates(
        gates.fail_under, gates.fail_over, gates.min_compression, gates.max_latency_ratio, gates.latency_tolerance
    )
    check_measurable(judged, runs=evaluation.timing.runs, task=evaluation.task, decode_steps=evaluation.decode_steps)
    chosen = parse_providers(evaluation.providers)
    if evaluation.require_providers:
        require_available(chosen)
    # the folder is created with the TensorRT session (qtool.evaluation.providers): after every other check
    cache = evaluation.trt_engine_cache
    if cache is not None and "TensorrtExecutionProvider" in chosen and cache.exists() and not cache.is_dir():
        raise QtoolError(f"--trt-engine-cache {cache} is not a directory")
    if evaluation.plot is not None:
        from qtool.reports.plot import require_matplotlib

        require_matplotlib()
    return judged, chosen


def _reported(reports: Reports, plot: Path | None, result: ComparisonResult) -> None:
    """The tables, and each report file asked for."""
    from qtool.graph.model_io import write_text
    from qtool.reports.ci import to_junit, to_markdown
    from qtool.reports.compare_document import comparison_to_dict
    from qtool.reports.documents import to_json
    from qtool.reports.tables import render_comparison

    render_comparison(summary_console(reports.json_out), result)
    if reports.json_out:
        write_json(reports.json_out, to_json(comparison_to_dict(result)))
    if reports.markdown:
        write_text(reports.markdown, to_markdown(result))
    if reports.junit:
        write_text(reports.junit, to_junit(result))
    if plot is not None:
        from qtool.reports.plot import plot_layers

        plot_layers(result.layers or [], plot)
