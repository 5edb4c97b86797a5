"""calibrate(), quantize(), inspect(), compare() and tune(): the public signatures over :mod:`qtool.pipeline`.

Each function checks its arguments before any work, opens a workspace and hands it to the
pipeline; the CLI and Python users call these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qtool.calibration.statistics import CalibrationStats
from qtool.config import load_config
from qtool.distributed.calibration import shard_request
from qtool.evaluation.compare import compare as _compare
from qtool.graph.model_io import write_text
from qtool.options import (
    DEFAULT_CALIBRATION,
    DEFAULT_OUTPUT,
    DEFAULT_SEARCH,
    DEFAULT_TUNE,
    QUANTIZE_EVALUATION,
    CalibrationOptions,
    EvaluationOptions,
    OutputOptions,
    SearchOptions,
    TuneOptions,
)
from qtool.pipeline import calibrate as calibration_pipeline
from qtool.pipeline import inspect as inspect_pipeline
from qtool.pipeline import quantize as quantize_pipeline
from qtool.pipeline import tune as tune_pipeline
from qtool.pipeline.choose import check_search
from qtool.pipeline.feeds import accepts_feeds
from qtool.pipeline.tune_checks import check_tunable, check_tune_outputs, tune_goal
from qtool.pipeline.workspace import open_workspace
from qtool.quantization.plan.inspection import Inspection
from qtool.results import ProgressFactory, QuantizeResult, TuneResult

ConfigSource = Path | str | Mapping[str, Any] | None  # a YAML file, a parsed document, or None: the default
InputShapes = Mapping[str, Sequence[int]] | None  # input name -> sizes fixing its dynamic dimensions but batch


@accepts_feeds
def calibrate(
    model_path: Path | str,
    data_dir: Path | str,
    *,
    config_path: ConfigSource = None,
    options: CalibrationOptions = DEFAULT_CALIBRATION,
    progress: ProgressFactory | None = None,
    target: str | None = None,
    input_shapes: InputShapes = None,
) -> CalibrationStats:
    """Observe every activation the quantizer needs over a dataset (a directory, URL or feeds).

    ``options``: observer, batch size, limit, shard, workers, NaN handling (over the config's
    ``calibration:``); ``target``: cpu, cpu_vnni, cuda or tensorrt instead of the config's ``target:``;
    ``input_shapes``: fixes dynamic dimensions other than batch (samples of another shape are refused).
    Returns the statistics, ready for :meth:`CalibrationStats.to_json` or :func:`quantize`.
    """
    config = load_config(config_path).with_target(target)
    ws = open_workspace(Path(model_path), config, input_shapes=input_shapes)
    request = None
    if options.workers is not None or options.scheduler is not None:
        request = shard_request(model_path, data_dir, config_path, options, target, input_shapes)
    return calibration_pipeline.calibrate(ws, data_dir, options, progress, request)


def merge_stats(paths: list[Path | str]) -> CalibrationStats:
    """Merge statistics files of dataset shards into the statistics of the whole dataset."""
    return CalibrationStats.merge_all([CalibrationStats.read(p) for p in paths])


def write_stats(stats: CalibrationStats, path: Path | str) -> None:
    """Write calibration statistics atomically as JSON."""
    write_text(path, stats.to_json())


@accepts_feeds
def quantize(
    model_path: Path | str,
    output_path: Path | str,
    *,
    config_path: ConfigSource = None,
    stats_path: Path | str | None = None,
    data_dir: Path | str | None = None,
    calibration: CalibrationOptions = DEFAULT_CALIBRATION,
    search: SearchOptions | None = DEFAULT_SEARCH,
    evaluation: EvaluationOptions | None = QUANTIZE_EVALUATION,
    eval_dir: Path | str | None = None,
    output: OutputOptions = DEFAULT_OUTPUT,
    progress: ProgressFactory | None = None,
    target: str | None = None,
    input_shapes: InputShapes = None,
    vs_onnxruntime: bool = False,
) -> QuantizeResult:
    """Quantize a float model to QDQ and write it atomically (nothing is written on bad input).

    Statistics come from ``stats_path`` (:func:`calibrate`'s) or from calibrating on ``data_dir``
    now; with neither, only a config that needs none is accepted (weight-only, fp16, dynamic).
    ``search`` (None: skip) runs the measured placement choice on ``search.data_dir`` or
    ``data_dir`` toward ``search.target_sqnr_db`` or the config's ``accuracy.target_sqnr_db``.
    ``evaluation`` (None: skip) compares the result with the float model on ``eval_dir``, or on
    the calibration samples with a warning that they are not held out. ``output``: external data
    and opset. ``target``: cpu, cpu_vnni, cuda or tensorrt (off the CPU nothing is timed). ``input_shapes``
    fixes dynamic dimensions for the work; the written model keeps the inputs it had. ``vs_onnxruntime``:
    onnxruntime's ``quantize_static`` model of the same file measured beside (:mod:`qtool.evaluation.peer`).
    """
    model_path, output_path = Path(model_path), Path(output_path)
    quantize_pipeline.check_sources(stats_path, data_dir, vs_onnxruntime)
    quantize_pipeline.check_outputs(model_path, output_path)
    config = load_config(config_path).with_target(target)
    if search is not None:
        check_search(search)  # before any work: a bad budget must not cost a calibration
    ws = open_workspace(model_path, config, output.opset, input_shapes)
    given = (output_path, stats_path, data_dir, calibration, search, evaluation, eval_dir, output, config_path)
    request = quantize_pipeline.QuantizeRequest(*given, input_shapes, vs_onnxruntime)
    return quantize_pipeline.quantize(ws, request, progress)


@accepts_feeds
def inspect(
    model_path: Path | str,
    *,
    config_path: ConfigSource = None,
    data_dir: Path | str | None = None,
    target: str | None = None,
    input_shapes: InputShapes = None,
) -> Inspection:
    """What quantize would do with this model and config: per-node schemes, float nodes, predicted size.

    ``data_dir``: its first calibration batch gives the tensor sizes dynamic shapes leave open, so
    ``placement: auto`` decides as quantize will (``input_shapes`` fixes them without data).
    """
    config = load_config(config_path).with_target(target)
    ws = open_workspace(Path(model_path), config, input_shapes=input_shapes)
    return inspect_pipeline.inspect(ws, data_dir)


compare = accepts_feeds(_compare)


def tune(
    model_path: Path | str,
    output_path: Path | str,
    config_out: Path | str,
    *,
    data_dir: Path | str,
    eval_dir: Path | str,
    options: TuneOptions = DEFAULT_TUNE,
    config_path: ConfigSource = None,
    calibration: CalibrationOptions = DEFAULT_CALIBRATION,
    target: str | None = None,
    input_shapes: InputShapes = None,
    progress: ProgressFactory | None = None,
) -> TuneResult:
    """The smallest (or fastest) model that meets a budget, and the config that reproduces it.

    See :mod:`qtool.pipeline.tune`. The chosen allocation is written as a QConfigDict to
    ``config_out``, and the model to ``output_path`` exactly as ``qtool quantize --config
    CONFIG_OUT --data DATA_DIR`` builds it. Raises QtoolError on bad input (nothing is written).
    """
    model_path, output_path, config_out = Path(model_path), Path(output_path), Path(config_out)
    goal = tune_goal(options)
    check_tune_outputs(model_path, output_path, config_out)
    config = load_config(config_path).with_target(target)
    check_tunable(config)
    request = tune_pipeline.TuneRequest(
        model_path, output_path, config_out, data_dir, eval_dir, options, calibration, input_shapes, goal
    )
    return tune_pipeline.tune(request, config, progress)
