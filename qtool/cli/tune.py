"""``qtool tune``: the smallest (or fastest) model that meets an accuracy budget, and its config."""

from __future__ import annotations

from functools import partial

from qtool.cli.app import app
from qtool.cli.options import (
    ConfigOption,
    InputShapesOption,
    JsonOption,
    ModelArgument,
    OutputsOption,
    TargetOption,
    ThreadsOption,
)
from qtool.cli.run import run_command
from qtool.cli.tune_options import (
    CacheDirOption,
    CacheOption,
    ConfidenceOption,
    ConfigOutOption,
    LabelsOption,
    LowerIsBetterOption,
    MetricOption,
    ObjectiveOption,
    SensitivitySamplesOption,
    TargetDecodeOption,
    TargetMetricOption,
    TimeBudgetOption,
    TuneArgs,
    TuneDataOption,
    TuneDecodeStepsOption,
    TuneEvalDataOption,
    TuneMaxLatencyRatioOption,
    TuneOutputOption,
    TunePlotOption,
    TuneTargetSqnrOption,
    tune_action,
)
from qtool.options import DECODE_STEPS


@app.command()
def tune(
    model: ModelArgument,
    data: TuneDataOption,
    eval_data: TuneEvalDataOption,
    output: TuneOutputOption,
    config_out: ConfigOutOption,
    target_sqnr: TuneTargetSqnrOption = None,
    metric: MetricOption = None,
    target_metric: TargetMetricOption = None,
    lower_is_better: LowerIsBetterOption = False,
    target_decode: TargetDecodeOption = None,
    decode_steps: TuneDecodeStepsOption = DECODE_STEPS,
    labels: LabelsOption = None,
    max_latency_ratio: TuneMaxLatencyRatioOption = None,
    objective: ObjectiveOption = "size",
    time_budget: TimeBudgetOption = 600.0,
    sensitivity_samples: SensitivitySamplesOption = 8,
    confidence: ConfidenceOption = 0.9,
    config: ConfigOption = None,
    target: TargetOption = None,
    input_shapes: InputShapesOption = None,
    threads: ThreadsOption = None,
    plot: TunePlotOption = None,
    json_out: JsonOption = None,
    cache: CacheOption = True,
    outputs: OutputsOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Find the smallest model (or the fastest) that meets an accuracy budget; write it and its config.

    EVAL is split in two. On the selection half, every node with a weight is measured alone at each
    precision its target allows (int2/int4/int8 weights, GPTQ or nearest rounding, int8/int16/float
    activations, fp16, float); precisions are then allocated for a noise budget and each allocation is
    built and verified, moving the budget until the best is found. The validation half scores the
    choice: the promise is the lower confidence bound of that figure. Exit 1 when no model meets it.
    """
    args = TuneArgs(**locals())

    run_command(
        partial(tune_action, args),
        {"-o": output, "--config-out": config_out, "--json": json_out, "--plot": plot},
        (model, config, data, eval_data, labels),
    )
