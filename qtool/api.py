"""calibrate(), quantize() and compare(): the orchestration shared by the CLI and Python users."""

from __future__ import annotations

import difflib
import functools
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from inspect import signature
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import onnx

from qtool import __version__
from qtool.calibration.dataset import Dataset, model_inputs
from qtool.calibration.feeds import sample_directory
from qtool.calibration.outputs import FloatOutputs
from qtool.calibration.remote import is_url, sample_files
from qtool.calibration.statistics import CalibrationStats, collect_statistics
from qtool.config import AccuracySettings, QConfig, load_config, split_observer
from qtool.errors import QtoolError
from qtool.evaluation.compare import compare as _compare
from qtool.evaluation.metrics import LatencyComparison, LatencyStats, paired_ratio
from qtool.evaluation.scoring import OutputScorer
from qtool.graph.input_shapes import fix_input_shapes, restore_input_dims
from qtool.graph.model_io import load_model, same_file, save_model, write_text
from qtool.graph.opsets import choose_opset, runtime_qdq_limit
from qtool.graph.prepare import PrepareReport, default_opset, prepare_model, refuse_quantized
from qtool.graph.session import check_runtime_support, create_session
from qtool.graph.weights import Weights
from qtool.observers import create_observer
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
from qtool.quantization.activations import activation_qparams, plan_activation_qparams
from qtool.quantization.algorithms.empirical_bias import measure_shifts, measured_layers
from qtool.quantization.algorithms.graph_transforms import (
    ChannelMaxima,
    InputMoments,
    apply_awq,
    apply_equalization,
    apply_smoothing,
    awq_readers,
    choose_awq_scales,
    smoothing_nodes,
    within_budget,
)
from qtool.quantization.algorithms.node_inputs import NodeInput, NodeInputCollector, node_input
from qtool.quantization.algorithms.smoothing import SmoothedGroup
from qtool.quantization.algorithms.weight_rounding import WeightAlgorithms
from qtool.quantization.inspection import Inspection, inspect_plan
from qtool.quantization.kernels import predict_kernels
from qtool.quantization.plan import QuantPlan, build_plan
from qtool.quantization.rewrite import RewriteReport, check_quantized_model, insert_qdq
from qtool.quantization.roles import static_elements
from qtool.quantization.selection import PlacementChoice, choose_placement
from qtool.quantization.tune.allocation import allocate, cheaper_moves, costlier_moves, predicted_nsr
from qtool.quantization.tune.cache import cache_key, default_cache_dir, load_sensitivity, save_sensitivity
from qtool.quantization.tune.candidates import Candidates, Goal, node_costs
from qtool.quantization.tune.configs import allocation_document, config_text
from qtool.quantization.tune.loop import Trial, best_trial, refine, search_budgets
from qtool.quantization.tune.metric import load_metric, read_labels
from qtool.quantization.tune.sensitivity import measure, nsr
from qtool.quantization.tune.space import (
    GPTQ,
    MEASURED,
    OPTIONS,
    W4,
    Option,
    for_objective,
    options_for,
    without_algorithms,
)
from qtool.results import ComparisonResult, ModelFile, ProgressFactory, QuantizeResult, TuneResult, noop_progress
from qtool.schemas.config import MAX_LATENCY_RUNS, MAX_SEARCH_SECONDS
from qtool.system.environment import cpu_info, files_digest, versions
from qtool.system.stages import stage

log = logging.getLogger(__name__)

_NEED_DATA = ("gptq", "adaround", "bias_correction")  # weight algorithms that need calibration inputs
RANK_SAMPLES = 4  # samples of the sensitivity search's one per-layer pass (spread over the data)


_F = TypeVar("_F", bound=Callable[..., Any])


def _accepts_feeds(func: _F) -> _F:
    """Let ``func``'s sample directories also be URLs, iterables of feeds or ``get_next()`` readers.

    ``data_dir``, ``eval_dir`` and ``search.data_dir`` become temporary sample directories for the
    call (see :mod:`qtool.calibration.feeds`); a comparison in the result names the data as given.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature(func).bind(*args, **kwargs)
        given = {key: bound.arguments.get(key) for key in ("data_dir", "eval_dir")}
        search = bound.arguments.get("search")
        search_data = search.data_dir if isinstance(search, SearchOptions) else None
        for_workers = _read_by_workers(bound.arguments)
        with (
            sample_directory(None if for_workers else given["data_dir"], "data") as directory,
            sample_directory(search_data, "search data") as search_directory,
            sample_directory(given["eval_dir"], "evaluation data") as eval_directory,
        ):
            if "data_dir" in bound.arguments and not for_workers:
                bound.arguments["data_dir"] = directory
            if "eval_dir" in bound.arguments:
                bound.arguments["eval_dir"] = eval_directory
            if isinstance(search, SearchOptions) and search_data is not None:
                bound.arguments["search"] = replace(search, data_dir=search_directory)
            result = func(*bound.args, **bound.kwargs)
        scored = "eval_dir" if given["eval_dir"] is not None else "data_dir"
        return _named_data(result, str(bound.arguments.get(scored)), given[scored])

    return cast(_F, wrapper)


def _named_data(result: Any, used: str, given: Any) -> Any:
    """``result`` with its comparison's data named as the caller gave it (a URL, feeds), not the temporary copy."""
    if given is None or (isinstance(given, (str, Path)) and not is_url(given)):
        return result
    shown = str(given) if is_url(given) else "feeds given from code"
    if isinstance(result, ComparisonResult) and result.data_dir == used:
        return replace(result, data_dir=shown)
    if isinstance(result, QuantizeResult) and result.comparison is not None and result.comparison.data_dir == used:
        result.comparison = replace(result.comparison, data_dir=shown)
    return result


def _read_by_workers(arguments: Mapping[str, Any]) -> bool:
    """Whether ``data_dir`` is a URL that a running scheduler's workers read themselves (no local copy)."""
    options = arguments.get("options")
    return is_url(arguments.get("data_dir")) and isinstance(options, CalibrationOptions) and bool(options.scheduler)


@dataclass(frozen=True)
class _Prepared:
    model: onnx.ModelProto
    prepared: onnx.ModelProto
    report: PrepareReport
    source: ModelFile  # the input model as read: its digest ties statistics to it
    weights: Weights  # the values of the prepared model's large initializers
    smoothed: tuple[SmoothedGroup, ...] = ()  # what SmoothQuant did to ``prepared``
    smoothing: dict[str, np.ndarray] = field(default_factory=dict)  # the channel maxima it smoothed with
    equalized: tuple[str, ...] = ()  # the Conv pairs equalization rescaled in ``prepared``
    awq: tuple[SmoothedGroup, ...] = ()  # what AWQ did to ``prepared``
    awq_notes: dict[str, str] = field(default_factory=dict)  # node -> why AWQ did not scale it
    original_inputs: tuple[onnx.ValueInfoProto, ...] = ()  # the inputs as read, before --input-shapes


def _prepare(
    model_path: Path, config: QConfig, opset: int | None = None, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> _Prepared:
    weights = Weights()
    with stage(f"load {model_path}"):
        model = load_model(model_path, weights)
    refuse_quantized(model, str(model_path))
    original_inputs = tuple(_copied(value) for value in model.graph.input)
    if input_shapes:
        fix_input_shapes(model, input_shapes, str(model_path))
    limit = runtime_qdq_limit(*config.quantized_dtypes())
    target = choose_opset(default_opset(model), config.opset_requirement(), limit, opset, source=str(model_path))
    check_runtime_support(model, str(model_path), target)
    with stage("prepare the graph"):
        prepared, report = prepare_model(model, weights, target_opset=target, source=str(model_path))
    node_names = [n.name for n in prepared.graph.node]
    unmatched = config.unmatched_node_patterns(node_names)
    for pattern in (p for p in unmatched if p.startswith("re:")):
        # A pattern may be written for a family of models; an exact name that misses is a typo.
        log.warning("%s: pattern '%s' matches no node of %s", config.source, pattern, model_path)
    exact = [p for p in unmatched if not p.startswith("re:")]
    if exact:
        close = difflib.get_close_matches(exact[0], node_names, n=3)
        raise QtoolError(
            f"{config.source}: node name '{exact[0]}' matches no node of {model_path}",
            hint=f"closest node names: {', '.join(close)}" if close else f"run qtool inspect {model_path}",
        )
    return _Prepared(model, prepared, report, ModelFile.of(model_path), weights, original_inputs=original_inputs)


def _copied(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    return copy


@_accepts_feeds
def calibrate(
    model_path: Path | str,
    data_dir: Path | str,
    *,
    config_path: Path | str | Mapping[str, Any] | None = None,
    options: CalibrationOptions = DEFAULT_CALIBRATION,
    progress: ProgressFactory | None = None,
    target: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> CalibrationStats:
    """Observe every activation the quantizer needs over a dataset.

    Args:
        model_path: the float ONNX model.
        data_dir: a dataset directory (see :class:`qtool.calibration.dataset.Dataset`).
        config_path: a QConfigDict YAML file; None for the built-in default.
        options: observer, batch size, limit, shard, NaN handling (over the config's ``calibration:``).
        progress: receives progress updates (the CLI draws a bar).
        target: ``cpu``, ``cuda`` or ``tensorrt`` instead of the config's ``target:`` (TensorRT
            observes the inputs of residual Adds too).
        input_shapes: input name -> sizes fixing its dynamic dimensions other than batch (see
            :mod:`qtool.graph.input_shapes`); samples of another shape are refused.

    Returns:
        The statistics, ready for :meth:`CalibrationStats.to_json` or :func:`quantize`.
    """
    config = load_config(config_path).with_target(target)
    state = _prepare(Path(model_path), config, input_shapes=input_shapes)
    if options.workers is not None or options.scheduler is not None:
        from qtool.distributed.calibration import calibrate_on_workers, shard_request

        if smoothing_nodes(state.prepared, config):
            raise QtoolError(
                "smoothquant needs the channel ranges of the whole data set before calibrating: "
                "calibrate without --workers/--scheduler",
                hint="or turn smoothquant off for distributed calibration",
            )
        if options.shard is not None:
            raise QtoolError("--shard and --workers/--scheduler: choose one (the workers split the samples themselves)")
        samples = _sample_count(state, config, data_dir, options)
        trusted = config.observer_references() | ({options.observer} if options.observer else set())
        request = shard_request(model_path, data_dir, config_path, options, target, input_shapes)
        return calibrate_on_workers(request, samples, frozenset(trusted), progress)
    if options.shard is not None and smoothing_nodes(state.prepared, config):
        raise QtoolError(
            "smoothquant needs the channel ranges of the whole data set before calibrating: calibrate without --shard",
            hint="or turn smoothquant off for sharded calibration",
        )
    state = _smoothed(_equalized(state, config), config, data_dir, options, None)
    return _calibrate(state, config, data_dir, options, progress)


def merge_stats(paths: list[Path | str]) -> CalibrationStats:
    """Merge statistics files of dataset shards into the statistics of the whole dataset."""
    return CalibrationStats.merge_all([CalibrationStats.read(p) for p in paths])


def _equalized(state: _Prepared, config: QConfig) -> _Prepared:
    """The model with its Conv chains equalized where the config asks (the pairs in ``equalized``)."""
    with stage("cross-layer equalization"):
        model, report = apply_equalization(state.prepared, state.weights, config)
    for skip in report.skipped:
        log.info("equalization left %s -> %s alone: %s", skip.first, skip.second, skip.reason)
    return replace(state, prepared=model, equalized=tuple(f"{p.first} -> {p.second}" for p in report.pairs))


def _smoothed(
    state: _Prepared,
    config: QConfig,
    data_dir: Path | str | None,
    options: CalibrationOptions,
    known: dict[str, np.ndarray] | None,
) -> _Prepared:
    """The model with SmoothQuant applied where the config asks (the channel maxima it used in ``smoothing``).

    ``known`` maxima (from a statistics file) are used as they are; otherwise a float pass over
    ``data_dir`` measures them.
    """
    nodes = smoothing_nodes(state.prepared, config)
    if not nodes:
        return state
    if known is None:
        assert data_dir is not None  # the callers pass data or known maxima
        tap = ChannelMaxima(sorted(set(nodes.values())))
        _tapped_pass(state, config, data_dir, options, tap, "SmoothQuant channel ranges")
        known = tap.maxima
    with stage("SmoothQuant"):
        model, report = apply_smoothing(state.prepared, state.weights, config, known)
    for tensor, reason in report.skipped:
        log.info("SmoothQuant left %s as it is: %s", tensor, reason)
    return replace(state, prepared=model, smoothed=report.groups, smoothing=known)


def _awq(state: _Prepared, config: QConfig, data_dir: Path | str | None, options: CalibrationOptions) -> _Prepared:
    """The model with AWQ's input-channel scales moved into its weight-only MatMul/Gemm weights.

    A float pass over ``data_dir`` measures each scaled input's mean |x| and second moment; without
    data the nodes keep their weights and the summary says why.
    """
    readers, notes = awq_readers(state.prepared, state.weights, config)
    if not readers:
        return replace(state, awq_notes=notes) if notes else state
    if data_dir is None:
        why = "awq: needs calibration samples (--data, or --search-data with --stats)"
        return replace(state, awq_notes={**notes, **{r.node: why for r in readers}})
    readers, over = within_budget(readers)
    notes.update({r.node: "awq: past the 1 GiB of activation second moments" for r in over})
    if not readers:
        return replace(state, awq_notes=notes)
    tap = InputMoments(sorted({r.tensor for r in readers}))
    _tapped_pass(state, config, data_dir, options, tap, "AWQ activation moments")
    with stage("AWQ"):
        scales, skipped = choose_awq_scales(readers, tap)
        model, report = apply_awq(state.prepared, state.weights, readers, scales)
    for tensor, reason in [*skipped.items(), *report.skipped]:
        for reader in readers:
            if reader.tensor == tensor:
                notes[reader.node] = reason if reason.startswith("awq") else f"awq: {reason}"
    return replace(state, prepared=model, awq=report.groups, awq_notes=notes)


def _input_collector(state: _Prepared, config: QConfig) -> NodeInputCollector | None:
    """A collector of the calibration inputs that the config's weight algorithms need (None: none do)."""
    plan = build_plan(state.prepared, config)
    inits = {i.name: i for i in state.prepared.graph.initializer}
    nodes = {n.name: n for n in state.prepared.graph.node}
    layouts = []
    skipped = {}
    for node in plan.nodes:
        if node.weight is None or not node.scheme.algorithms.need_inputs:
            continue
        if node.placement == "lookup":
            skipped[node.name] = "a table lookup has no inputs to weigh its rounding errors by"
            continue
        shape = tuple(int(d) for d in inits[node.weight.name].dims)
        layout = node_input(nodes[node.name], node.weight.name, shape)
        if isinstance(layout, str):
            skipped[node.name] = layout
        else:
            layouts.append((layout, shape))
    if not layouts and not skipped:
        return None
    collector = NodeInputCollector(layouts)
    collector.result.skipped.update(skipped)
    return collector


def _sample_count(state: _Prepared, config: QConfig, data_dir: Path | str, options: CalibrationOptions) -> int:
    """How many samples calibration reads (a URL's are counted by listing it, without reading them)."""
    if not is_url(data_dir):
        return len(_calibration_dataset(state, config, data_dir, options))
    samples = len({relative.split("/")[0] for _, relative in sample_files(str(data_dir))})
    if samples == 0:
        raise QtoolError(f"data directory {data_dir} holds no samples")
    limit = options.limit or config.calibration.limit
    return min(samples, limit) if limit else samples


def _calibration_dataset(
    state: _Prepared, config: QConfig, data_dir: Path | str, options: CalibrationOptions
) -> Dataset:
    return Dataset(
        data_dir,
        model_inputs(state.model),
        limit=options.limit or config.calibration.limit,
        shard=options.shard,
        preprocess=config.preprocess,
        skip_nonfinite=options.skip_nonfinite,
    )


def _calibrate(
    state: _Prepared,
    config: QConfig,
    data_dir: Path | str,
    options: CalibrationOptions,
    progress: ProgressFactory | None,
    outputs: FloatOutputs | None = None,
    inputs: NodeInputCollector | None = None,
) -> CalibrationStats:
    name = options.observer or config.calibration.observer
    observer_options = dict(config.calibration.observer_options) if name == config.calibration.observer else {}
    observer_options.update(options.observer_options)
    create_observer(name, None, observer_options)  # fail on an unknown name or option before any work
    # Without tensor sizes every "auto" node is planned integer: calibration observes all it may need.
    plan = build_plan(state.prepared, config)
    if not plan.activations and inputs is None:  # weight-only: no activation needs a range, skip the float pass
        return CalibrationStats(
            state.source.sha256, name, 0, {}, smoothing=state.smoothing, equalized=list(state.equalized)
        )
    shard = options.shard
    dataset = _calibration_dataset(state, config, data_dir, options)
    if inputs is not None:
        inputs.expect(len(dataset))
    advance = (progress or noop_progress)("calibrating", len(dataset))
    with stage("calibrate (float pass)"):
        observers, seen, elements = collect_statistics(
            state.prepared,
            plan.activations,
            dataset,
            observer=name,
            options=observer_options,
            per_tensor={
                tensor: split_observer(scheme.observer)
                for tensor, scheme in plan.activations.items()
                if scheme.observer is not None
            },
            batch_size=options.batch_size or config.calibration.batch_size,
            on_progress=advance,
            weights=state.weights,
            outputs=outputs,
            taps=[inputs] if inputs is not None else [],
            threads=options.threads,
        )
    if seen == 0:
        skipped = f" ({len(dataset.skipped)} skipped for holding NaN or Inf)" if dataset.skipped else ""
        raise QtoolError(f"no sample of {data_dir} could be observed{skipped}: there are no statistics to write")
    return CalibrationStats(
        state.source.sha256,
        name,
        seen,
        observers,
        f"{shard[0]}/{shard[1]}" if shard else None,
        len(dataset.skipped),
        elements,
        smoothing=state.smoothing,
        equalized=list(state.equalized),
    )


def _quantize_in_memory(
    state: _Prepared, config: QConfig, stats: CalibrationStats, algorithms: WeightAlgorithms | None = None
) -> tuple[QuantPlan, onnx.ModelProto, RewriteReport]:
    # With tensor sizes known, placement "auto" can now choose integer kernels or storage per node.
    plan = build_plan(state.prepared, config, {**static_elements(state.prepared), **stats.elements})
    act_qparams = plan_activation_qparams(plan, stats.tensors)
    wanted = {} if algorithms is None else _empirical_bias_nodes(plan, algorithms)
    if not wanted:
        quantized, report = insert_qdq(state.prepared, plan, act_qparams, state.weights, algorithms)
        return plan, quantized, report
    assert algorithms is not None  # wanted is empty without it
    # Bias correction measures each layer's own mean error on the model as rounded, then corrects it.
    # The placement choice builds its winner again at the end: its measurement is kept by plan.
    key = repr((plan.nodes, sorted((t, repr(q)) for t, q in act_qparams.items())))
    if key not in algorithms.shifts:
        rounded, _ = insert_qdq(state.prepared, plan, act_qparams, state.weights, algorithms, correct_biases=False)
        layers, skipped = measured_layers(rounded, state.prepared, state.weights, wanted)
        shifts, few = measure_shifts(rounded, state.weights, layers, algorithms.inputs.feeds)
        algorithms.shifts[key] = (shifts, {**skipped, **few})
    shifts, skipped = algorithms.shifts[key]
    measured: dict[str, np.ndarray | None] = {**dict.fromkeys(wanted), **shifts}
    quantized, report = insert_qdq(state.prepared, plan, act_qparams, state.weights, algorithms, measured)
    for node, reason in skipped.items():
        report.algorithm_notes.setdefault(node, f"bias_correction: {reason}")
    return plan, quantized, report


def _empirical_bias_nodes(plan: QuantPlan, algorithms: WeightAlgorithms) -> dict[str, NodeInput]:
    """Plan nodes whose bias correction is measured on the quantized model (needs the kept samples).

    Only nodes whose inputs are quantized: their output mean also drifts with the rounded input, which
    only a run of the quantized model shows. A node with float inputs (weight-only, storage) drifts by
    its rounded weight alone, which the analytic correction cancels exactly from the float input means,
    without a model run (so each node's correction is the same in every plan: tune relies on it).
    """
    if not algorithms.inputs.feeds:
        return {}
    return {
        node.name: algorithms.inputs.layouts[node.name]
        for node in plan.nodes
        if node.scheme.algorithms.bias_correction and node.name in algorithms.inputs.layouts and node.quantized_inputs
    }


def _without_data(state: _Prepared, config: QConfig, model_path: Path) -> CalibrationStats:
    """Empty statistics for a config that needs none (weight-only, fp16, ``mode: dynamic``), else a clear error."""
    plan = build_plan(state.prepared, config, static_elements(state.prepared))
    needs = [f"{len(plan.activations)} activations are quantized statically"] if plan.activations else []
    asked = sorted({name for n in plan.nodes for name in n.scheme.algorithms.names()})
    needs += [f"{', '.join(asked)} need calibration inputs"] if asked else []
    if needs:
        raise QtoolError(
            f"{model_path}: {'; '.join(needs)}: give --data DATA_DIR or --stats STATS.json",
            hint="without data only weights can be quantized: weight_only: true, fp16 weights, or mode: dynamic",
        )
    return CalibrationStats(
        state.source.sha256, config.calibration.observer, 0, {}, elements=static_elements(state.prepared)
    )


def _weight_algorithms(
    state: _Prepared,
    config: QConfig,
    collector: NodeInputCollector | None,
    data_dir: Path | str | None,
    search_dir: Path | str | None,
    calibration: CalibrationOptions,
) -> tuple[WeightAlgorithms | None, str | None]:
    """The weight algorithms' inputs: gathered by calibration, or by a pass over the search data.

    Returns them (None when no node asks for an algorithm) and a note when they could not be had.
    """
    if collector is None:
        return None, None
    if data_dir is None:
        if search_dir is None:
            plan = build_plan(state.prepared, config)
            asked = sorted({name for n in plan.nodes for name in n.scheme.algorithms.names() if name in _NEED_DATA})
            note = (
                f"{', '.join(asked)} need calibration samples: give --data (or --search-data with --stats); "
                "weights were rounded to nearest"
            )
            log.warning(note)
            return None, note
        _tapped_pass(state, config, search_dir, calibration, collector, "calibration inputs of the weight algorithms")
    return WeightAlgorithms(collector.result), None


def _tapped_pass(
    state: _Prepared,
    config: QConfig,
    data_dir: Path | str,
    options: CalibrationOptions,
    tap: NodeInputCollector | ChannelMaxima | InputMoments,
    what: str,
) -> None:
    """A float pass over ``data_dir`` (the calibration samples, as calibrate reads them) that only feeds ``tap``."""
    dataset = Dataset(
        data_dir,
        model_inputs(state.model),
        limit=options.limit or config.calibration.limit,
        preprocess=config.preprocess,
        skip_nonfinite=options.skip_nonfinite,
    )
    if isinstance(tap, NodeInputCollector):
        tap.expect(len(dataset))
    with stage(f"{what} (float pass)"):
        collect_statistics(
            state.prepared,
            [],
            dataset,
            observer=config.calibration.observer,
            batch_size=options.batch_size or config.calibration.batch_size,
            weights=state.weights,
            taps=[tap],
        )


def _check_transforms(stats: CalibrationStats, state: _Prepared, config: QConfig, path: Path | str) -> None:
    """Statistics describe the model as transformed when they were taken: the config must transform it alike."""
    pairs = list(state.equalized)
    if pairs != stats.equalized:
        if stats.equalized:
            then = f"with cross-layer equalization of {len(stats.equalized)} Conv pairs"
        else:
            then = "without cross-layer equalization"
        now = f"equalizes {len(pairs)}" if pairs else "equalizes none"
        raise QtoolError(
            f"{path} was calibrated {then}; this config {now}",
            hint="quantize with the config you calibrated with, or re-run qtool calibrate",
        )
    wanted = set(smoothing_nodes(state.prepared, config).values())
    if wanted and not stats.smoothing:
        raise QtoolError(
            f"{path} was calibrated without SmoothQuant, which this config turns on",
            hint="re-run qtool calibrate with this config",
        )
    if stats.smoothing and not wanted:
        raise QtoolError(
            f"{path} was calibrated with SmoothQuant, which this config leaves off",
            hint="quantize with the config you calibrated with, or re-run qtool calibrate",
        )
    missing = sorted(wanted - set(stats.smoothing))
    if missing:
        raise QtoolError(
            f"{path} has no SmoothQuant channel ranges for tensor '{missing[0]}'",
            hint="re-run qtool calibrate with this config",
        )


def _check_search(search: SearchOptions) -> None:
    """Refuse search settings that cannot mean anything (the config's are checked by its schema)."""
    if (search.max_float_nodes is not None and search.max_float_nodes < 1) or (
        search.samples is not None and search.samples < 1
    ):
        raise QtoolError("--max-float-nodes and the number of search samples must be >= 1")
    if search.search_seconds is not None and not 0 < search.search_seconds <= MAX_SEARCH_SECONDS:
        raise QtoolError(f"--search-seconds must be a number of seconds above 0 (at most {MAX_SEARCH_SECONDS})")
    if search.latency_runs is not None and not 0 <= search.latency_runs <= MAX_LATENCY_RUNS:
        raise QtoolError(f"--latency-runs must be an integer from 0 to {MAX_LATENCY_RUNS}")


def _choose_placement(
    state: _Prepared,
    config: QConfig,
    stats: CalibrationStats,
    data_dir: Path | str,
    search: SearchOptions,
    evaluation: EvaluationOptions,
    progress: ProgressFactory | None,
    known: FloatOutputs | None,
    algorithms: WeightAlgorithms | None,
) -> tuple[QConfig, PlacementChoice | None]:
    given = config.accuracy
    accuracy = AccuracySettings(
        target_sqnr_db=given.target_sqnr_db if search.target_sqnr_db is None else search.target_sqnr_db,
        max_float_nodes=given.max_float_nodes if search.max_float_nodes is None else search.max_float_nodes,
        samples=given.samples if search.samples is None else search.samples,
        search_seconds=given.search_seconds if search.search_seconds is None else search.search_seconds,
        latency_runs=given.latency_runs if search.latency_runs is None else search.latency_runs,
    )
    if accuracy.target_sqnr_db is None:
        return config, None
    config = replace(config, accuracy=accuracy)

    def spread(count: int) -> Dataset:
        return Dataset(
            data_dir,
            model_inputs(state.model),
            spread=count,
            preprocess=config.preprocess,
            skip_nonfinite=evaluation.skip_nonfinite,
        )

    def build(cfg: QConfig) -> tuple[QuantPlan, onnx.ModelProto]:
        plan, model, _ = _quantize_in_memory(state, cfg, stats, algorithms)
        return plan, model

    return choose_placement(
        Path(state.source.path),
        state.prepared,
        config,
        build,
        spread(accuracy.samples),
        spread(min(RANK_SAMPLES, accuracy.samples)),
        weights=state.weights,
        threads=evaluation.threads,
        elements={**static_elements(state.prepared), **stats.elements},
        progress=progress,
        known=known,
    )


@_accepts_feeds
def quantize(
    model_path: Path | str,
    output_path: Path | str,
    *,
    config_path: Path | str | Mapping[str, Any] | None = None,
    stats_path: Path | str | None = None,
    data_dir: Path | str | None = None,
    calibration: CalibrationOptions = DEFAULT_CALIBRATION,
    search: SearchOptions | None = DEFAULT_SEARCH,
    evaluation: EvaluationOptions | None = QUANTIZE_EVALUATION,
    eval_dir: Path | str | None = None,
    output: OutputOptions = DEFAULT_OUTPUT,
    progress: ProgressFactory | None = None,
    target: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> QuantizeResult:
    """Quantize a float model to QDQ and write it atomically.

    Args:
        model_path: the float ONNX model.
        output_path: the ``.onnx`` file to write (never the input).
        config_path: a QConfigDict YAML file; None for the built-in default.
        stats_path: statistics from :func:`calibrate` (at most one of this and ``data_dir``).
        data_dir: calibrate on these samples now (with ``calibration``). Without either, only a config
            that needs no statistics is accepted (weights stored quantized, fp16, ``mode: dynamic``).
        calibration: how to calibrate with ``data_dir``; its observer also vouches for a
            ``package.module:Class`` named in ``stats_path``.
        search: the sensitivity search, run when it has samples (``search.data_dir`` or ``data_dir``)
            and a target (``search.target_sqnr_db`` or the config's ``accuracy.target_sqnr_db``);
            None skips it.
        evaluation: with ``data_dir`` or ``eval_dir``, compare the result with the float model;
            None skips it. Its threads and NaN handling also apply to the search.
        eval_dir: held-out samples to compare on; without it the comparison scores the calibration
            samples (``data_dir``), warns that they are not held out and says so in the result.
        output: external data and the output opset (see :mod:`qtool.graph.opsets`).
        progress: receives progress updates (the CLI draws a bar).
        target: ``cpu``, ``cuda`` or ``tensorrt`` instead of the config's ``target:``
            (see :func:`qtool.config.for_target`). Off the CPU, the placement follows the
            target's rules: CPU latency says nothing about a GPU, so no placement is measured.
        input_shapes: input name -> sizes fixing its dynamic dimensions other than batch for the
            work (calibration, placement, evaluation); the written model keeps the inputs it had.

    Raises:
        QtoolError: bad input; nothing is written in that case.
    """
    model_path, output_path = Path(model_path), Path(output_path)
    if stats_path is not None and data_dir is not None:
        raise QtoolError("give either --stats STATS.json or --data DATA_DIR, not both")
    if output_path.suffix.lower() != ".onnx":
        raise QtoolError(f"output path {output_path} must end in .onnx")
    if same_file(model_path, output_path):
        raise QtoolError(
            f"output {output_path} is the input model; qtool never overwrites its input", hint="choose another -o path"
        )
    config = load_config(config_path).with_target(target)
    if search is not None:
        _check_search(search)  # before any work: a bad budget must not cost a calibration
    state = _prepare(model_path, config, output.opset, input_shapes)
    kept_outputs: FloatOutputs | None = None
    if stats_path is not None:
        # a module:Class observer in the file is imported only if the user named it too
        trusted = config.observer_references() | ({calibration.observer} if calibration.observer else set())
        stats = CalibrationStats.read(stats_path, trusted)
        if stats.model_sha256 != state.source.sha256:
            raise QtoolError(
                f"{stats_path} was computed for a different model than {model_path}",
                hint="re-run qtool calibrate on this model",
            )
        state = _equalized(state, config)
        _check_transforms(stats, state, config, stats_path)
        state = _smoothed(state, config, None, calibration, stats.smoothing)
        state = _awq(state, config, search.data_dir if search is not None else None, calibration)
        collector = _input_collector(state, config)
    elif data_dir is None:
        stats = _without_data(state, config, model_path)
        collector = None
    else:
        state = _smoothed(_equalized(state, config), config, data_dir, calibration, None)
        state = _awq(state, config, data_dir, calibration)
        collector = _input_collector(state, config)
        # the float outputs it computes anyway serve the placement choice and the comparison
        kept_outputs = FloatOutputs()
        stats = _calibrate(state, config, data_dir, calibration, progress, kept_outputs, collector)
    search_dir = (search.data_dir or data_dir) if search is not None else None
    algorithms, algorithm_note = _weight_algorithms(state, config, collector, data_dir, search_dir, calibration)
    choice = None
    if config.target != "cpu" and search is not None and search_dir is not None:
        log.info("target %s: placement by its rules (CPU timing says nothing about it)", config.target)
    elif search is not None and search_dir is not None:
        with stage("placement choice (accuracy, search, latency)"):
            config, choice = _choose_placement(
                state,
                config,
                stats,
                search_dir,
                search,
                evaluation or QUANTIZE_EVALUATION,
                progress,
                kept_outputs,
                algorithms,
            )
    with stage("insert Q/DQ"):
        plan, quantized, rewrite_report = _quantize_in_memory(state, config, stats, algorithms)
    for pair in state.equalized:
        for node in pair.split(" -> "):
            rewrite_report.algorithms.setdefault(node, []).insert(0, "equalization")
    for group in state.smoothed:
        for node in group.nodes:
            rewrite_report.algorithms.setdefault(node, []).insert(0, "smoothquant")
    for group in state.awq:
        for node in group.nodes:
            rewrite_report.algorithms.setdefault(node, []).insert(0, "awq")
    for node, note in state.awq_notes.items():
        rewrite_report.algorithm_notes.setdefault(node, note)
    state.weights.retain(quantized)  # the float weights the output replaced: freed before it is checked and written
    quantized.producer_name = "qtool"
    quantized.producer_version = __version__
    restore_input_dims(quantized, state.original_inputs)
    check_note = check_quantized_model(quantized, state.prepared)
    with stage("load the result in onnxruntime"):
        create_session(quantized, "the quantized model", weights=state.weights)  # onnxruntime loads it: write it
    with stage(f"write {output_path}"):
        written = save_model(quantized, output_path, state.weights, external=output.external_data)
    result = QuantizeResult(
        source=state.source,
        output=ModelFile.of(output_path),
        prepare=state.report,
        rewrite=rewrite_report,
        skipped=list(plan.skipped),
        placements=dict(sorted(Counter(node.placement for node in plan.nodes).items())),
        kernels=dict(sorted(Counter(k.kernel for k in predict_kernels(state.prepared, plan).values()).items())),
        calibration_samples=stats.samples,
        fallback=choice.search if choice else None,
        placement_choice=choice,
        data_files=[str(p) for p in written[1:]],
    )
    if check_note:
        result.notes.append(check_note)
    if algorithm_note:
        result.notes.append(algorithm_note)
    if state.report.initializers_removed_from_inputs:
        result.notes.append(
            f"{state.report.initializers_removed_from_inputs} initializers were listed as graph inputs; "
            "they are treated as constants and no longer inputs"
        )
    if state.report.shape_inference_error:
        result.notes.append(f"shape inference failed and was skipped: {state.report.shape_inference_error}")
    scored = eval_dir if eval_dir is not None else data_dir
    if scored is not None and evaluation is not None:
        timed = choice is not None and choice.chosen in choice.times and evaluation.runs > 0
        if eval_dir is None:
            log.warning(
                "the comparison scores the model on the samples it was calibrated on (%s): not held out, "
                "so optimistic; give --eval DIR for held-out samples",
                data_dir,
            )
        result.comparison = _compare(
            model_path,
            output_path,
            scored,
            options=replace(evaluation, runs=0) if timed else evaluation,
            config_path=config_path,
            progress=progress,
            reference_outputs=kept_outputs if eval_dir is None else None,
            input_shapes=input_shapes,
        )
        result.comparison = replace(result.comparison, calibration_data=eval_dir is None)
        if timed:
            assert choice is not None  # checked in timed
            # The choice already timed this very model against fp32, interleaved: that is the latency to report.
            ratio, interval = paired_ratio(choice.times["fp32"], choice.times[choice.chosen])
            latency = LatencyComparison(
                "CPUExecutionProvider",
                choice.threads,
                LatencyStats.from_seconds(choice.times["fp32"]),
                LatencyStats.from_seconds(choice.times[choice.chosen]),
                ratio=ratio,
                ratio_interval=interval,
            )
            reproducibility = {
                **result.comparison.reproducibility,
                "threads": {"intra_op": choice.threads, "onnxruntime_default": False},
                "providers_measured": [latency.provider],
            }
            result.comparison = replace(result.comparison, latency=[latency], reproducibility=reproducibility)
    return result


@_accepts_feeds
def inspect(
    model_path: Path | str,
    *,
    config_path: Path | str | Mapping[str, Any] | None = None,
    data_dir: Path | str | None = None,
    target: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> Inspection:
    """What quantize would do with this model and config: per-node schemes, float nodes, predicted size.

    Args:
        model_path: the float model.
        config_path: a QConfigDict YAML file; None for the built-in default.
        data_dir: a sample directory; its first batch (the config's ``calibration.batch_size``)
            gives tensor sizes that the model's dynamic shapes leave open, per sample as quantize
            counts them, so ``placement: auto`` decides as quantize will.
        target: ``cpu``, ``cuda`` or ``tensorrt`` instead of the config's ``target:``: what each
            node becomes there.
        input_shapes: input name -> sizes fixing its dynamic dimensions other than batch, so that
            tensor sizes (and ``placement: auto``) are known without data.
    """
    config = load_config(config_path).with_target(target)
    state = _prepare(Path(model_path), config, input_shapes=input_shapes)
    elements = static_elements(state.prepared)
    if data_dir is not None:
        # quantize takes each tensor's per-sample size from its first calibration batch: run just that batch
        first_batch = min(config.calibration.batch_size, config.calibration.limit or config.calibration.batch_size)
        sizing = CalibrationOptions(observer="minmax", batch_size=config.calibration.batch_size, limit=first_batch)
        elements.update(_calibrate(state, config, data_dir, sizing, None).elements)
    plan = build_plan(state.prepared, config, elements)
    result = inspect_plan(str(model_path), state.source.size_bytes, state.prepared, plan, config)
    # The exact size comes from doing the rewrite with placeholder activation ranges: only scale values
    # differ from the real run, and they take the same bytes.
    placeholder = {
        tensor: activation_qparams(np.asarray(-1.0), np.asarray(1.0), scheme, what=tensor)
        for tensor, scheme in plan.activations.items()
    }
    rewritten, _ = insert_qdq(state.prepared, plan, placeholder, state.weights)
    rewritten.producer_name, rewritten.producer_version = "qtool", __version__
    return replace(result, rewritten_bytes=state.weights.embedded_size(rewritten))


def write_stats(stats: CalibrationStats, path: Path | str) -> None:
    """Write calibration statistics atomically as JSON."""
    write_text(path, stats.to_json())


compare = _accepts_feeds(_compare)


def tune(
    model_path: Path | str,
    output_path: Path | str,
    config_out: Path | str,
    *,
    data_dir: Path | str,
    eval_dir: Path | str,
    options: TuneOptions = DEFAULT_TUNE,
    config_path: Path | str | Mapping[str, Any] | None = None,
    calibration: CalibrationOptions = DEFAULT_CALIBRATION,
    target: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    progress: ProgressFactory | None = None,
) -> TuneResult:
    """The smallest (or fastest) model that meets a budget, and the config that reproduces it.

    Calibrates once on ``data_dir``, measures what each tuned node (every node with a constant
    weight) adds to the output error at each precision its target allows, one node at a time on
    ``options.sensitivity_samples`` samples of ``eval_dir``, then allocates precisions for a noise
    budget and verifies each allocation on all of ``eval_dir`` (see :mod:`qtool.quantization.tune`). The
    chosen allocation is written as a QConfigDict to ``config_out`` and the model is built from it
    exactly as ``qtool quantize --config CONFIG_OUT --data DATA_DIR`` builds it.

    Raises:
        QtoolError: bad input (nothing is written then).
    """
    started = time.monotonic()
    deadline = started + options.time_budget
    model_path, output_path, config_out = Path(model_path), Path(output_path), Path(config_out)
    goal = _tune_goal(options, eval_dir)
    _check_tune_outputs(model_path, output_path, config_out)
    config = load_config(config_path).with_target(target)
    if config.global_scheme.algorithms.names():
        raise QtoolError(
            f"{config.source}: tune does not search accuracy algorithms yet; "
            f"give a config without global.algorithms ({', '.join(config.global_scheme.algorithms.names())})"
        )
    timed = options.objective == "latency" or options.max_latency_ratio is not None
    space = for_objective(options_for(config.target), timed)
    # Candidates are built at the opset the widest option needs (int2 weights: 25), so each one loads.
    opset = max(load_config({**config.raw, "global": o.entry}).opset_requirement()[0] for o in space if o.entry)
    state = _prepare(model_path, config, opset, input_shapes)
    # GPTQ options need each node's calibration inputs: gathered in the same float pass (within the
    # collector's memory budget; nodes past it are rounded to nearest, as quantize would)
    global_with_gptq = {
        **config.raw["global"],
        "algorithms": {**config.raw["global"]["algorithms"], **GPTQ["algorithms"]},
    }
    wants_inputs = len(without_algorithms(space)) < len(space)
    collector = (
        _input_collector(state, load_config({**config.raw, "global": global_with_gptq})) if wants_inputs else None
    )
    stats = _calibrate(state, config, data_dir, calibration, progress, inputs=collector)
    algorithms = WeightAlgorithms(collector.result) if collector is not None else None
    if algorithms is None:
        space = without_algorithms(space)
    elements = {**static_elements(state.prepared), **stats.elements}
    plan = build_plan(state.prepared, config, elements)
    shapes = {init.name: list(init.dims) for init in state.prepared.graph.initializer}
    weight_shape = {n.name: shapes[n.weight.name] for n in plan.nodes if n.weight is not None}
    tuned = sorted(
        (n for n in plan.nodes if n.name in weight_shape), key=lambda n: (-int(np.prod(weight_shape[n.name])), n.name)
    )
    if not tuned:
        raise QtoolError(f"{model_path} has no node with a constant weight to tune")
    op_types = {n.op_type for n in plan.nodes}
    inputs = model_inputs(state.model)
    held_out = Dataset(eval_dir, inputs, preprocess=config.preprocess)
    # Each node is measured on EVAL samples, the set the target is judged on: calibration samples can
    # miss the inputs that break a model (PP-OCRv4 det, one int8 layer alone: 46 dB on four CALIB crops,
    # 35 dB on the EVAL crops, where sparse text makes every stray pixel count).
    spread = Dataset(eval_dir, inputs, spread=options.sensitivity_samples, preprocess=config.preprocess)
    labels = read_labels(options.labels, len(held_out)) if options.labels is not None else None
    goal = replace(goal, labels=labels)
    threads = options.threads

    def build(allocation: Mapping[str, Option | str]) -> onnx.ModelProto:
        document = allocation_document(config.raw, op_types, allocation)
        _, model, _ = _quantize_in_memory(state, load_config(document), stats, algorithms)
        return model

    cache_dir = _tune_cache_dir(options)
    key = ""
    if cache_dir is not None:
        key = cache_key(
            {
                "versions": versions(),
                "cpu": cpu_info(),  # integer kernels differ with the instruction set (VNNI or not)
                "model": state.source.sha256,
                "config": config.raw,
                "opset": opset,
                "input_shapes": dict(input_shapes or {}),
                "calibration": asdict(calibration),
                "data": files_digest(Dataset(data_dir, inputs, preprocess=config.preprocess).files),
                "sensitivity_samples": files_digest(spread.files),
                "space": [(o.name, o.entry) for o in space],
                "nodes": [n.name for n in tuned],
                "threads": threads,
            }
        )
    eval_scorer = OutputScorer(state.prepared, held_out, threads=threads, weights=state.weights)
    sens = load_sensitivity(cache_dir, key) if cache_dir is not None else None
    if sens is None:
        sensitivity_scorer = OutputScorer(
            state.prepared, spread, threads=threads, weights=state.weights, known=eval_scorer.float_outputs()
        )

        def isolated_sqnr(selection: dict[str, Option]) -> float:
            return sensitivity_scorer.score(build(selection), "a node alone").worst_db

        with stage(f"sensitivity of {len(tuned)} nodes"):
            measured = len(tuned) * len([o for o in space if o.name in MEASURED])
            sens = measure(
                [n.name for n in tuned],
                space,
                isolated_sqnr,
                deadline=started + SENSITIVITY_SHARE * options.time_budget,
                advance=(progress or noop_progress)("sensitivity", measured),
            )
        sensitivity_scorer.release()
        if cache_dir is not None:
            sens.cache_file = save_sensitivity(cache_dir, key, sens)
    sens.samples = [path.name for path in spread.files]  # in the cache key: the same files when read back
    candidates = Candidates(
        state.prepared,
        eval_scorer,
        state.weights,
        state.source.size_bytes,
        goal,
        timed=timed,
        latency_runs=options.latency_runs,
        threads=threads,
    )
    names = [n.name for n in tuned]
    option_names = [o.name for o in space]
    work = {n.name: n.macs or 0 for n in tuned}
    costs = node_costs(
        names,
        weight_shape,
        {n.name: n.weight.axis if n.weight is not None else None for n in tuned},
        _block_axes(state, config),
        work,
        options.objective,
        option_names,
        lambda o: OPTIONS[o].integer,
    )
    first = nsr(goal.target_sqnr_db) if goal.target_sqnr_db is not None else FIRST_METRIC_BUDGET
    trials: list[Trial] = []
    out_of_time = False
    tiers = [option_names]
    if timed:  # low-bit weight-only nodes dequantize at run time: the fallback tier runs at float speed or faster
        tiers.append([o for o in option_names if o not in ("w2", "w4")])

    def verify(allocation: dict[str, str]) -> Trial:
        return candidates.verify(build(allocation), allocation, predicted_nsr(allocation, sens))

    with stage("allocate and verify"):
        for allowed in tiers:

            def allocate_for(budget: float, allowed: list[str] = allowed) -> dict[str, str]:
                return allocate(names, allowed, costs, sens, budget)

            search = search_budgets(
                first,
                allocate_for,
                lambda allocation, budget: verify(allocation),
                goal.slack_db,
                deadline=deadline,
            )
            trials += search.trials
            out_of_time = out_of_time or search.out_of_time
            if best_trial(trials, options.objective) is not None or out_of_time:
                break
    best = best_trial(trials, options.objective)
    if best is not None and options.objective == "size" and not out_of_time:
        with stage("refine the best allocation"):
            refined = refine(
                best,
                lambda allocation, rejected: cheaper_moves(allocation, option_names, costs, sens, rejected),
                verify,
                deadline=deadline,
                max_trials=REFINE_TRIALS_PER_NODE * len(names) + 10,
                upgrades=lambda allocation: costlier_moves(allocation, option_names, costs, sens),
                restart_trials=len(names),
            )
        trials += refined.trials
        out_of_time = refined.out_of_time
    chosen = best_trial(trials, options.objective)
    met = chosen is not None
    if chosen is None:
        if not trials:
            raise QtoolError(
                f"--time-budget {options.time_budget:g} s ran out before any candidate was verified",
                hint="give a larger --time-budget",
            )
        chosen = max(
            trials,
            key=lambda t: (t.metric if t.metric is not None else t.sqnr_db) * (-1 if goal.lower_is_better else 1),
        )
    document = allocation_document(config.raw, op_types, chosen.allocation)
    header = (
        f"Chosen by qtool tune {__version__} for {model_path.name}: {goal.describe()}, objective {options.objective}.\n"
        f"Reproduce: qtool quantize {model_path.name} --config {config_out.name} --data {data_dir} -o OUT.onnx"
    )
    text = config_text(document, header)
    with tempfile.TemporaryDirectory(prefix="qtool-tune-") as scratch:
        # The build reads the config as quantize --config will; -o and --config-out are committed together.
        built_from = Path(scratch) / config_out.name
        built_from.write_text(text)
        with stage(f"write {output_path}"):
            quantize(
                model_path,
                output_path,
                config_path=built_from,
                data_dir=data_dir,
                calibration=calibration,
                evaluation=None,
                input_shapes=input_shapes,
            )
    write_text(config_out, text)
    with stage("score the written model"):
        # The written model is built by quantize's own path: score it too, so the report states what was written.
        written = candidates.verify(onnx.load(str(output_path)), chosen.allocation, nsr(chosen.predicted_db))
    notes = []
    if met and not written.meets:
        met = False
        notes.append(
            f"the written model measures {written.sqnr_db:.2f} dB on EVAL where its candidate measured "
            f"{chosen.sqnr_db:.2f} dB: it misses the target"
        )
    if not sens.complete:
        notes.append(
            "the time budget cut the sensitivity measurement short: unmeasured nodes use the worst measured figures"
        )
    return TuneResult(
        source=state.source,
        output=ModelFile.of(output_path),
        config_out=str(config_out),
        objective=options.objective,
        goal=goal.describe(),
        nodes=len(tuned),
        trials=trials,
        chosen=chosen,
        written=written,
        met=met,
        out_of_time=out_of_time,
        sensitivity=sens,
        seconds=time.monotonic() - started,
        notes=notes,
    )


def _tune_cache_dir(options: TuneOptions) -> Path | None:
    """Where tune keeps its measurements (None: --no-cache, or no folder to use)."""
    if not options.cache:
        return None
    return Path(options.cache_dir) if options.cache_dir is not None else default_cache_dir()


def _block_axes(state: _Prepared, config: QConfig) -> dict[str, int | None]:
    """Each weighted node's per-block axis (the reduction axis), as the plan of per-block weights has it."""
    blocked = load_config({**config.raw, "global": W4.entry})
    plan = build_plan(state.prepared, blocked)
    return {n.name: n.weight.axis for n in plan.nodes if n.weight is not None}


REFINE_TRIALS_PER_NODE = 8  # verifications the refinement (descent and restarts) may spend, per tuned node
SENSITIVITY_SHARE = 0.6  # of the time budget, at most, for measuring nodes one at a time
FIRST_METRIC_BUDGET = 1e-3  # noise-to-signal power to start from with a metric goal (30 dB)


def _tune_goal(options: TuneOptions, eval_dir: Path | str) -> Goal:
    """Check the goal options before any work."""
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
    )


def _check_tune_outputs(model_path: Path, output_path: Path, config_out: Path) -> None:
    if output_path.suffix.lower() != ".onnx":
        raise QtoolError(f"output path {output_path} must end in .onnx")
    if config_out.suffix.lower() not in (".yaml", ".yml"):
        raise QtoolError(f"--config-out {config_out} must end in .yaml")
    for path in (output_path, config_out):
        if same_file(model_path, path):
            raise QtoolError(f"{path} is the input model; qtool never overwrites its input")
        if not path.parent.exists():
            raise QtoolError(f"the folder of {path} does not exist")
