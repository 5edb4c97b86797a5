"""``qtool compare``: accuracy, latency and gates for CI."""

from __future__ import annotations

from functools import partial

from qtool.cli.app import app
from qtool.cli.compare_options import (
    BaselineOption,
    CandidateArgument,
    CompareArgs,
    DecodeStepsOption,
    EvalDataOption,
    FailOnRegressionOption,
    FailOverOption,
    FailUnderOption,
    JunitOption,
    LatencyToleranceOption,
    MarkdownOption,
    MaxLatencyRatioOption,
    MinCompressionOption,
    PerLayerOption,
    PlotOption,
    PreprocessConfigOption,
    ProvidersOption,
    ReferenceArgument,
    RequireProvidersOption,
    TaskOption,
    TrtEngineCacheOption,
    compare_action,
)
from qtool.cli.options import (
    GateOutputsOption,
    InputShapesOption,
    JsonOption,
    LimitOption,
    RunsOption,
    SkipNonfiniteOption,
    ThreadsOption,
    WarmupOption,
)
from qtool.cli.run import run_command
from qtool.options import DECODE_STEPS


@app.command()
def compare(
    reference: ReferenceArgument,
    candidate: CandidateArgument,
    data: EvalDataOption,
    config: PreprocessConfigOption = None,
    input_shapes: InputShapesOption = None,
    limit: LimitOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    task: TaskOption = "auto",
    decode_steps: DecodeStepsOption = DECODE_STEPS,
    per_layer: PerLayerOption = False,
    plot: PlotOption = None,
    providers: ProvidersOption = "cpu",
    require_providers: RequireProvidersOption = False,
    trt_engine_cache: TrtEngineCacheOption = None,
    runs: RunsOption = 50,
    warmup: WarmupOption = 5,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
    markdown: MarkdownOption = None,
    junit: JunitOption = None,
    fail_under: FailUnderOption = None,
    fail_over: FailOverOption = None,
    min_compression: MinCompressionOption = None,
    max_latency_ratio: MaxLatencyRatioOption = None,
    baseline: BaselineOption = None,
    fail_on_regression: FailOnRegressionOption = False,
    outputs: GateOutputsOption = None,
    latency_tolerance: LatencyToleranceOption = None,
) -> None:
    """Compare CANDIDATE with REFERENCE: size, accuracy, per-layer error, latency per provider; judge gates.

    Exit code 1 when any gate fails (after printing every gate), 2 on bad input.
    """
    args = CompareArgs(**locals())
    written = {"--json": json_out, "--markdown": markdown, "--junit": junit, "--plot": plot}
    run_command(partial(compare_action, args), written, (reference, candidate, data, config, baseline))
