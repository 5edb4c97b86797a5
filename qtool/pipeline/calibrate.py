"""Statistics for a workspace: observed in one float pass, read from a file, or none needed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qtool.calibration.feeds import sample_directory
from qtool.calibration.outputs import FloatOutputs
from qtool.calibration.statistics import CalibrationStats, FloatPass, Observing, collect_statistics
from qtool.calibration.taps import BatchTap
from qtool.config import load_config, split_observer
from qtool.distributed.calibration import ShardRequest, calibrate_on_workers
from qtool.errors import QtoolError
from qtool.evaluation.judged import judged_outputs
from qtool.observers import create_observer
from qtool.options import CalibrationOptions
from qtool.pipeline.data import calibration_dataset, sample_count
from qtool.pipeline.passes import BEFORE_CALIBRATION, PassInputs, check_passes, run_passes
from qtool.pipeline.workspace import Workspace, open_workspace
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.algorithms.rounding.node_inputs import NodeInputCollector
from qtool.schemes import TensorScheme
from qtool.system.stages import stage


def observe(
    ws: Workspace,
    data_dir: Path | str,
    options: CalibrationOptions,
    progress: ProgressFactory | None = None,
    known: FloatOutputs | None = None,
    inputs: NodeInputCollector | None = None,
    cache: BatchTap | None = None,
) -> CalibrationStats:
    """One float pass over the calibration samples: the plan's activation ranges, plus what the taps keep.

    ``known`` keeps the float outputs (the placement choice and the comparison reuse them);
    ``inputs`` gathers the weight algorithms' calibration inputs; ``cache``, a decoder's key/value cache ranges.
    """
    config = ws.config
    plan = ws.plan()  # without tensor sizes every "auto" node is planned integer: all it may need is observed
    activations = plan.every_activation()  # the bodies' too: observed on the samples and iterations that run them
    observing = _observing(ws, options, activations)
    name, done = observing.observer, ws.transforms
    taps = [tap for tap in (inputs, cache) if tap is not None]
    if not activations and not taps:  # weight-only: no activation needs a range, skip the float pass
        return CalibrationStats(ws.source.sha256, name, 0, {}, smoothing=done.smoothing, equalized=list(done.equalized))
    dataset = calibration_dataset(ws, data_dir, options)
    if inputs is not None:
        inputs.expect(len(dataset))
    advance = (progress or noop_progress)("calibrating", len(dataset))
    with stage("calibrate (float pass)"):
        state = tuple(sorted(judged_outputs(ws.prepared, pairs=config.accuracy.state).state.items()))  # carried
        batch = options.batch_size or config.calibration.batch_size
        observers, seen, elements = collect_statistics(
            ws.prepared,
            activations,
            dataset,
            observing,
            FloatPass(batch, options.threads, ws.weights, state),
            on_progress=advance,
            known=known,
            taps=taps,
        )
    if seen == 0:
        skipped = f" ({len(dataset.skipped)} skipped for holding NaN or Inf)" if dataset.skipped else ""
        raise QtoolError(f"no sample of {data_dir} could be observed{skipped}: there are no statistics to write")
    shard = options.shard
    return CalibrationStats(
        ws.source.sha256,
        name,
        seen,
        observers,
        f"{shard[0]}/{shard[1]}" if shard else None,
        len(dataset.skipped),
        elements,
        smoothing=done.smoothing,
        equalized=list(done.equalized),
    )


def _observing(ws: Workspace, options: CalibrationOptions, activations: Mapping[str, TensorScheme]) -> Observing:
    """The observer of every activation: the command line's over the config's, a rule's own where it names one.

    Raises:
        QtoolError: an unknown observer or option (before any work).
    """
    calibration = ws.config.calibration
    name = options.observer or calibration.observer
    observer_options = dict(calibration.observer_options) if name == calibration.observer else {}
    observer_options.update(options.observer_options)
    create_observer(name, None, observer_options)  # fail on an unknown name or option before any work
    per_tensor = {t: split_observer(s.observer) for t, s in activations.items() if s.observer is not None}
    return Observing(name, observer_options, per_tensor)


def without_data(ws: Workspace) -> CalibrationStats:
    """Empty statistics for a config that needs none (weight-only, fp16, ``mode: dynamic``), else a clear error."""
    plan = ws.plan(elements=ws.sizes())
    activations = plan.every_activation()
    needs = [f"{len(activations)} activations are quantized statically"] if activations else []
    asked = sorted({name for n in plan.nodes for name in n.scheme.algorithms.names()})
    needs += [f"{', '.join(asked)} need calibration inputs"] if asked else []
    if needs:
        raise QtoolError(
            f"{ws.path}: {'; '.join(needs)}: give --data DATA_DIR or --stats STATS.json",
            hint="without data only weights can be quantized: weight_only: true, fp16 weights, or mode: dynamic",
        )
    return CalibrationStats(ws.source.sha256, ws.config.calibration.observer, 0, {}, elements=ws.sizes())


def read_statistics(ws: Workspace, stats_path: Path | str, trusted: frozenset[str]) -> CalibrationStats:
    """A statistics file, refused when it was computed for another model."""
    stats = CalibrationStats.read(stats_path, trusted)
    if stats.model_sha256 != ws.source.sha256:
        raise QtoolError(
            f"{stats_path} was computed for a different model than {ws.path}",
            hint="re-run qtool calibrate on this model",
        )
    return stats


def calibrate(
    ws: Workspace,
    data_dir: Path | str,
    options: CalibrationOptions,
    progress: ProgressFactory | None,
    request: ShardRequest | None = None,
) -> CalibrationStats:
    """The ``calibrate`` command: passes, then one float pass (or shards on an engine's workers).

    ``request`` describes the run for workers, when ``options`` asks for them. The passes refuse
    what they cannot work with (SmoothQuant: workers, a shard) before any of them runs or any worker starts.
    """
    inputs = PassInputs(data_dir, options)
    if options.workers is not None or options.scheduler is not None:
        assert request is not None  # built by the caller whenever workers are asked for
        check_passes(ws, BEFORE_CALIBRATION, inputs)  # here, before any worker starts: each runs them on its shard
        if options.shard is not None:
            raise QtoolError("--shard and --workers/--scheduler: choose one (the workers split the samples themselves)")
        samples = sample_count(ws, data_dir, options)
        trusted = ws.config.observer_references() | ({options.observer} if options.observer else set())
        return calibrate_on_workers(request, samples, frozenset(trusted), progress, calibrate_shard)
    run_passes(ws, BEFORE_CALIBRATION, inputs)
    return observe(ws, data_dir, options, progress)


def calibrate_shard(request: ShardRequest, report: Callable[[int], None]) -> dict[str, Any]:
    """Runs on a worker: the statistics of one shard, as :meth:`CalibrationStats.to_dict`."""
    config = load_config(request.config).with_target(request.target)
    ws = open_workspace(Path(request.model), config, input_shapes=request.input_shapes)
    with sample_directory(request.data, "data") as directory:  # a URL: read into a local copy
        assert directory is not None  # a request always names its data
        stats = calibrate(ws, directory, request.options, lambda description, total: report)
    return stats.to_dict()
