"""``tune``'s arguments checked before any work: the goal, the output paths, the config."""

from __future__ import annotations

import math
from pathlib import Path

from qtool.choice.tune.candidates import Goal
from qtool.choice.tune.metric import load_metric
from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.evaluation.language_model import MAX_DECODE_STEPS
from qtool.graph.model_files import same_file
from qtool.options import TuneOptions


def tune_goal(options: TuneOptions) -> Goal:
    """The goal the options describe (the user's metric imported), or a clear error."""
    goals = [options.target_sqnr_db is not None, options.metric is not None, options.target_decode is not None]
    if sum(goals) != 1:
        raise QtoolError("give exactly one of --target-sqnr DB, --metric module:function and --target-decode SHARE")
    if options.metric is not None and options.target_metric is None:
        raise QtoolError("--metric needs --target-metric X (the value the metric must reach)")
    if options.target_metric is not None and options.metric is None:
        raise QtoolError("--target-metric without --metric module:function")
    if options.lower_is_better and options.metric is None:
        raise QtoolError("--lower-is-better without --metric: SQNR and decode agreement are higher-is-better")
    if options.labels is not None and options.metric is None:
        raise QtoolError("--labels without --metric: labels are passed to the metric")
    if options.objective not in ("size", "latency"):
        raise QtoolError(f"--objective must be size or latency, not '{options.objective}'")
    if not 0 < options.time_budget <= 24 * 3600:
        raise QtoolError("--time-budget must be a number of seconds above 0 (at most a day)")
    if options.max_latency_ratio is not None and not options.max_latency_ratio > 0:
        raise QtoolError("--max-latency-ratio must be above 0")
    if options.sensitivity_samples < 1:
        raise QtoolError(f"--sensitivity-samples must be >= 1, got {options.sensitivity_samples}")
    if options.latency_runs < 8:
        raise QtoolError(
            f"TuneOptions.latency_runs must be >= 8 (timed rounds per candidate), got {options.latency_runs}"
        )
    if not 0.5 <= options.confidence < 1:
        raise QtoolError(f"--confidence {options.confidence:g} must be at least 0.5 and below 1 (e.g. 0.9)")
    if options.target_sqnr_db is not None and not 0 < options.target_sqnr_db < 200:
        raise QtoolError(f"--target-sqnr {options.target_sqnr_db:g} dB is outside (0, 200)")
    if options.target_metric is not None and not math.isfinite(options.target_metric):
        raise QtoolError(
            f"--target-metric {options.target_metric:g} is not a number a metric can reach",
            hint="give the finite value the mean --metric must reach",
        )
    if not 1 <= options.decode_steps <= MAX_DECODE_STEPS:  # whichever goal: a value out of range is a typo
        raise QtoolError(f"--decode-steps must be between 1 and {MAX_DECODE_STEPS}, got {options.decode_steps}")
    if options.target_decode is not None:
        return _decode_goal(options)
    metric = load_metric(options.metric) if options.metric is not None else None
    return Goal(
        target_sqnr_db=options.target_sqnr_db,
        metric=metric,
        metric_name=options.metric or "",
        target_metric=options.target_metric,
        lower_is_better=options.lower_is_better,
        max_latency_ratio=options.max_latency_ratio,
        confidence=options.confidence,
    )


def _decode_goal(options: TuneOptions) -> Goal:
    """A decoder's goal: the mean free-running agreement of ``decode_steps`` greedy steps per sample."""
    assert options.target_decode is not None
    if not 0 < options.target_decode <= 1:
        raise QtoolError(
            f"--target-decode {options.target_decode:g} is a share of generated tokens: above 0 and at most 1",
            hint="e.g. --target-decode 0.9 (90 % of the greedy tokens as the float model's)",
        )
    return Goal(
        metric_name=f"free-running agreement ({options.decode_steps} steps)",
        target_metric=options.target_decode,
        max_latency_ratio=options.max_latency_ratio,
        confidence=options.confidence,
        decode_steps=options.decode_steps,
    )


def check_tune_outputs(model_path: Path, output_path: Path, config_out: Path) -> None:
    """The model and the config to write: new files of the right kinds, in folders that exist."""
    if output_path.suffix.lower() != ".onnx":
        raise QtoolError(f"output path {output_path} must end in .onnx")
    if config_out.suffix.lower() not in (".yaml", ".yml"):
        raise QtoolError(f"--config-out {config_out} must end in .yaml")
    for path in (output_path, config_out):
        if same_file(model_path, path):
            raise QtoolError(f"{path} is the input model; qtool never overwrites its input")
        if not path.parent.exists():
            raise QtoolError(f"the folder of {path} does not exist")


def check_tunable(config: QConfig) -> None:
    """Refuse a config that asks for accuracy algorithms anywhere (tune searches weight precisions only).

    tune replaces the op_type and node_name rules with its own allocation: algorithms asked for there
    would be dropped without a word, so they are refused like global ones.
    """
    if config.global_scheme.algorithms.names():
        raise QtoolError(
            f"{config.source}: tune does not search accuracy algorithms yet; "
            f"give a config without global.algorithms ({', '.join(config.global_scheme.algorithms.names())})"
        )
    for section in ("op_type", "node_name"):
        rules = config.raw.get(section) or {}
        for name, rule in rules.items() if isinstance(rules, dict) else ():
            algorithms = rule.get("algorithms") if isinstance(rule, dict) else None
            if isinstance(algorithms, dict) and _turned_on(algorithms):
                raise QtoolError(
                    f"{config.source}: tune does not search accuracy algorithms yet, and replaces {section} rules "
                    f"with its allocation; give a config without {section}.{name}.algorithms"
                )


def _turned_on(algorithms: dict[str, object]) -> bool:
    """Whether an ``algorithms:`` mapping turns any algorithm on (nearest rounding and false toggles do not)."""
    rounding = algorithms.get("rounding")
    toggles = ("bias_correction", "equalization", "smoothquant", "awq")
    return (rounding is not None and rounding != "nearest") or any(algorithms.get(t) is True for t in toggles)
