"""``tune``'s arguments checked before any work: the goal, the output paths, the config."""

from __future__ import annotations

from pathlib import Path

from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.graph.model_io import same_file
from qtool.options import TuneOptions
from qtool.quantization.tune.candidates import Goal
from qtool.quantization.tune.metric import load_metric


def tune_goal(options: TuneOptions) -> Goal:
    """The goal the options describe (the user's metric imported), or a clear error."""
    if (options.target_sqnr_db is None) == (options.metric is None):
        raise QtoolError("give exactly one of --target-sqnr DB and --metric module:function")
    if options.metric is not None and options.target_metric is None:
        raise QtoolError("--metric needs --target-metric X (the value the metric must reach)")
    if options.target_metric is not None and options.metric is None:
        raise QtoolError("--target-metric without --metric module:function")
    if options.labels is not None and options.metric is None:
        raise QtoolError("--labels without --metric: labels are passed to the metric")
    if options.objective not in ("size", "latency"):
        raise QtoolError(f"--objective must be size or latency, not '{options.objective}'")
    if not 0 < options.time_budget <= 24 * 3600:
        raise QtoolError("--time-budget must be a number of seconds above 0 (at most a day)")
    if options.max_latency_ratio is not None and not options.max_latency_ratio > 0:
        raise QtoolError("--max-latency-ratio must be above 0")
    if options.sensitivity_samples < 1 or options.latency_runs < 8:
        raise QtoolError("--sensitivity-samples must be >= 1 and --latency-runs >= 8")
    if not 0.5 <= options.confidence < 1:
        raise QtoolError(f"--confidence {options.confidence:g} must be at least 0.5 and below 1 (e.g. 0.9)")
    if options.target_sqnr_db is not None and not 0 < options.target_sqnr_db < 200:
        raise QtoolError(f"--target-sqnr {options.target_sqnr_db:g} dB is outside (0, 200)")
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
    """Refuse a config whose global section asks for accuracy algorithms (tune searches weight precisions only)."""
    if config.global_scheme.algorithms.names():
        raise QtoolError(
            f"{config.source}: tune does not search accuracy algorithms yet; "
            f"give a config without global.algorithms ({', '.join(config.global_scheme.algorithms.names())})"
        )
