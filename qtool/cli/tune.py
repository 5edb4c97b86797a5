"""``qtool tune``: the smallest (or fastest) model that meets an accuracy budget, and its config."""

from __future__ import annotations

from functools import partial

from qtool.cli.app import app
from qtool.cli.groups import option_groups
from qtool.cli.options import ConfigOption, InputShapesOption, JsonOption, ModelArgument, TargetOption
from qtool.cli.run import run_command
from qtool.cli.tune_options import TuneData, TuneSearch, TuneWritten, tune_action


@app.command()
@option_groups
def tune(
    model: ModelArgument,
    *,
    data: TuneData,
    written: TuneWritten,
    search: TuneSearch,
    config: ConfigOption = None,
    target: TargetOption = None,
    input_shapes: InputShapesOption = None,
    json_out: JsonOption = None,
) -> None:
    """Find the smallest model (or the fastest) that meets an accuracy budget; write it and its config.

    EVAL is split in two. On the selection half, every node with a weight is measured alone at each
    precision its target allows (int2/int4/int8 weights, GPTQ or nearest rounding, int8/int16/float
    activations, fp16, float); precisions are then allocated for a noise budget and each allocation is
    built and verified, moving the budget until the best is found. The validation half scores the
    choice: the promise is the lower confidence bound of that figure. Exit 1 when no model meets it.
    """
    run_command(
        partial(tune_action, model, data, written, search, config, target, input_shapes, json_out),
        {"-o": written.output, "--config-out": written.config_out, "--json": json_out, "--plot": written.plot},
        (model, config, data.data, data.eval_data, search.labels),
    )
