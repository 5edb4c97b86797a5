"""The ``tune`` pipeline: one calibration, each node's sensitivity, allocations verified, the chosen one written.

Calibrates once on the calibration samples, measures what each tuned node (every node with a
constant weight) adds to the output error at each precision its target allows, one node at a
time on samples of EVAL, then allocates precisions for a noise budget and verifies each
allocation on all of EVAL (see :mod:`qtool.quantization.tune`). Every candidate is built by the
workspace's :class:`~qtool.pipeline.build.Builder`. The chosen allocation is written as a
QConfigDict and the model is built from it exactly as ``qtool quantize --config`` builds it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from qtool._version import __version__
from qtool.calibration.dataset import Dataset
from qtool.calibration.feeds import sample_directory
from qtool.config import QConfig, load_config
from qtool.errors import QtoolError
from qtool.evaluation.scoring import OutputScorer
from qtool.graph.model_io import write_text
from qtool.options import DEFAULT_OUTPUT, DEFAULT_SEARCH, CalibrationOptions, TuneOptions
from qtool.pipeline.build import Builder, input_collector
from qtool.pipeline.calibrate import observe
from qtool.pipeline.data import full_dataset, spread_dataset
from qtool.pipeline.quantize import QuantizeRequest, quantize
from qtool.pipeline.workspace import Workspace, open_workspace
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.algorithms.weight_rounding import WeightAlgorithms
from qtool.quantization.plan_types import NodePlan
from qtool.quantization.tune.allocation import allocate, cheaper_moves, costlier_moves, predicted_nsr
from qtool.quantization.tune.cache import cache_key, default_cache_dir, load_sensitivity, save_sensitivity
from qtool.quantization.tune.candidates import Candidates, Goal, node_costs
from qtool.quantization.tune.configs import allocation_document, config_text
from qtool.quantization.tune.loop import Trial, best_trial, refine, search_budgets
from qtool.quantization.tune.metric import read_labels
from qtool.quantization.tune.sensitivity import Sensitivity, measure, nsr
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
from qtool.results import ModelFile, TuneResult
from qtool.system.environment import cpu_info, files_digest, versions
from qtool.system.stages import stage

REFINE_TRIALS_PER_NODE = 8  # verifications the refinement (descent and restarts) may spend, per tuned node
SENSITIVITY_SHARE = 0.6  # of the time budget, at most, for measuring nodes one at a time
FIRST_METRIC_BUDGET = 1e-3  # noise-to-signal power to start from with a metric goal (30 dB)


@dataclass(frozen=True)
class TuneRequest:
    """What one ``tune`` run reads and writes."""

    model_path: Path
    output_path: Path
    config_out: Path
    data_dir: Path | str
    eval_dir: Path | str
    options: TuneOptions
    calibration: CalibrationOptions
    input_shapes: Mapping[str, Sequence[int]] | None
    goal: Goal


@dataclass
class Tuning:
    """The state every step of a tune run shares: the workspace, its builder, the nodes and the space."""

    request: TuneRequest
    ws: Workspace
    builder: Builder
    space: list[Option]
    tuned: list[NodePlan]  # nodes with a constant weight, largest first
    weight_shape: dict[str, list[int]]
    op_types: set[str]
    goal: Goal
    held_out: Dataset  # EVAL: every candidate is verified on it
    spread: Dataset  # samples of EVAL each node is measured on
    opset: int  # the widest option's: every candidate is built at it
    started: float

    @property
    def deadline(self) -> float:
        return self.started + self.request.options.time_budget

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.tuned]

    def build(self, allocation: Mapping[str, Option | str]) -> onnx.ModelProto:
        """The model of an allocation (node -> option): every tuned op type float, each node its option's rule."""
        rules = {}
        for node in sorted(allocation):
            option = allocation[node]
            settings = (OPTIONS[option] if isinstance(option, str) else option).settings
            if settings is not None:
                rules[node] = settings
        op_type = dict.fromkeys(sorted(self.op_types))
        return self.builder.build(self.ws.config.with_rules(op_type=op_type, node_name=rules, exclude=())).model


def tune(request: TuneRequest, config: QConfig, progress: ProgressFactory | None) -> TuneResult:
    """Tune ``request.model_path`` under ``config`` (see the module docstring)."""
    tuning = _prepare(request, config, progress, time.monotonic())
    options = request.options
    eval_scorer = OutputScorer(tuning.ws.prepared, tuning.held_out, threads=options.threads, weights=tuning.ws.weights)
    sens = _sensitivity(tuning, eval_scorer, progress)
    candidates = Candidates(
        tuning.ws.prepared,
        eval_scorer,
        tuning.ws.weights,
        tuning.ws.source.size_bytes,
        tuning.goal,
        timed=_timed(options),
        latency_runs=options.latency_runs,
        threads=options.threads,
    )
    trials, out_of_time = _search(tuning, sens, candidates)
    return _write_chosen(tuning, sens, candidates, trials, out_of_time)


def _timed(options: TuneOptions) -> bool:
    return options.objective == "latency" or options.max_latency_ratio is not None


def _prepare(request: TuneRequest, config: QConfig, progress: ProgressFactory | None, started: float) -> Tuning:
    """The workspace at the widest option's opset, calibrated once (with the GPTQ inputs when the space has GPTQ)."""
    space = for_objective(options_for(config.target), _timed(request.options))
    # Candidates are built at the opset the widest option needs (int2 weights: 25), so each one loads.
    opset = max(config.with_rules(global_=o.entry).opset_requirement()[0] for o in space if o.entry)
    ws = open_workspace(request.model_path, config, opset, request.input_shapes)
    # GPTQ options need each node's calibration inputs: gathered in the same float pass (within the
    # collector's memory budget; nodes past it are rounded to nearest, as quantize would)
    wants_inputs = len(without_algorithms(space)) < len(space)
    collector = input_collector(ws, config.with_rules(global_=GPTQ)) if wants_inputs else None
    stats = observe(ws, request.data_dir, request.calibration, progress, inputs=collector)
    algorithms = WeightAlgorithms(collector.result) if collector is not None else None
    if algorithms is None:
        space = without_algorithms(space)
    builder = Builder(ws, stats, algorithms)
    plan = builder.plan(config)
    shapes = {init.name: list(init.dims) for init in ws.prepared.graph.initializer}
    weight_shape = {n.name: shapes[n.weight.name] for n in plan.nodes if n.weight is not None}
    tuned = sorted(
        (n for n in plan.nodes if n.name in weight_shape), key=lambda n: (-int(np.prod(weight_shape[n.name])), n.name)
    )
    if not tuned:
        raise QtoolError(f"{request.model_path} has no node with a constant weight to tune")
    held_out = full_dataset(ws, request.eval_dir)
    # Each node is measured on EVAL samples, the set the target is judged on: calibration samples can
    # miss the inputs that break a model (PP-OCRv4 det, one int8 layer alone: 46 dB on four CALIB crops,
    # 35 dB on the EVAL crops, where sparse text makes every stray pixel count).
    spread = spread_dataset(ws, request.eval_dir, request.options.sensitivity_samples)
    labels = read_labels(request.options.labels, len(held_out)) if request.options.labels is not None else None
    goal = replace(request.goal, labels=labels)
    op_types = {n.op_type for n in plan.nodes}
    return Tuning(request, ws, builder, space, tuned, weight_shape, op_types, goal, held_out, spread, opset, started)


def _cache_key(tuning: Tuning) -> str:
    """The key of the sensitivity measurement: everything it depends on."""
    request, ws = tuning.request, tuning.ws
    return cache_key(
        {
            "versions": versions(),
            "cpu": cpu_info(),  # integer kernels differ with the instruction set (VNNI or not)
            "model": ws.source.sha256,
            "config": ws.config.raw,
            "opset": tuning.opset,
            "input_shapes": dict(request.input_shapes or {}),
            "calibration": asdict(request.calibration),
            "data": files_digest(full_dataset(ws, request.data_dir).files),
            "sensitivity_samples": files_digest(tuning.spread.files),
            "space": [(o.name, o.entry) for o in tuning.space],
            "nodes": tuning.names,
            "threads": request.options.threads,
        }
    )


def _sensitivity(tuning: Tuning, eval_scorer: OutputScorer, progress: ProgressFactory | None) -> Sensitivity:
    """Each node's noise at each option, alone: from the cache, or measured (and cached)."""
    options = tuning.request.options
    cache_dir = _cache_dir(options)
    key = _cache_key(tuning) if cache_dir is not None else ""
    sens = load_sensitivity(cache_dir, key) if cache_dir is not None else None
    if sens is None:
        ws = tuning.ws
        scorer = OutputScorer(
            ws.prepared, tuning.spread, threads=options.threads, weights=ws.weights, known=eval_scorer.float_outputs()
        )

        def isolated_sqnr(selection: dict[str, Option]) -> float:
            return scorer.score(tuning.build(selection), "a node alone").worst_db

        with stage(f"sensitivity of {len(tuning.tuned)} nodes"):
            measured = len(tuning.tuned) * len([o for o in tuning.space if o.name in MEASURED])
            sens = measure(
                tuning.names,
                tuning.space,
                isolated_sqnr,
                deadline=tuning.started + SENSITIVITY_SHARE * options.time_budget,
                advance=(progress or noop_progress)("sensitivity", measured),
            )
        scorer.release()
        if cache_dir is not None:
            sens.cache_file = save_sensitivity(cache_dir, key, sens)
    sens.samples = [path.name for path in tuning.spread.files]  # in the cache key: the same files when read back
    return sens


def _cache_dir(options: TuneOptions) -> Path | None:
    """Where tune keeps its measurements (None: --no-cache, or no folder to use)."""
    if not options.cache:
        return None
    return Path(options.cache_dir) if options.cache_dir is not None else default_cache_dir()


def _block_axes(tuning: Tuning) -> dict[str, int | None]:
    """Each weighted node's per-block axis (the reduction axis), as the plan of per-block weights has it."""
    blocked = tuning.ws.config.with_rules(global_=W4.entry)
    return {n.name: n.weight.axis for n in tuning.ws.plan(blocked).nodes if n.weight is not None}


def _search(tuning: Tuning, sens: Sensitivity, candidates: Candidates) -> tuple[list[Trial], bool]:
    """Allocations for a shrinking noise budget, verified; then the best one refined (size objective)."""
    options, goal, names = tuning.request.options, tuning.goal, tuning.names
    option_names = [o.name for o in tuning.space]
    costs = node_costs(
        names,
        tuning.weight_shape,
        {n.name: n.weight.axis if n.weight is not None else None for n in tuning.tuned},
        _block_axes(tuning),
        {n.name: n.macs or 0 for n in tuning.tuned},
        options.objective,
        option_names,
        lambda o: OPTIONS[o].integer,
    )
    first = nsr(goal.target_sqnr_db) if goal.target_sqnr_db is not None else FIRST_METRIC_BUDGET
    trials: list[Trial] = []
    out_of_time = False
    tiers = [option_names]
    if _timed(options):  # low-bit weight-only nodes dequantize at run time: the fallback tier runs at float speed
        tiers.append([o for o in option_names if o not in ("w2", "w4")])

    def verify(allocation: dict[str, str]) -> Trial:
        return candidates.verify(tuning.build(allocation), allocation, predicted_nsr(allocation, sens))

    with stage("allocate and verify"):
        for allowed in tiers:

            def allocate_for(budget: float, allowed: list[str] = allowed) -> dict[str, str]:
                return allocate(names, allowed, costs, sens, budget)

            found = search_budgets(
                first,
                allocate_for,
                lambda allocation, budget: verify(allocation),
                goal.slack_db,
                deadline=tuning.deadline,
            )
            trials += found.trials
            out_of_time = out_of_time or found.out_of_time
            if best_trial(trials, options.objective) is not None or out_of_time:
                break
    best = best_trial(trials, options.objective)
    if best is not None and options.objective == "size" and not out_of_time:
        with stage("refine the best allocation"):
            refined = refine(
                best,
                lambda allocation, rejected: cheaper_moves(allocation, option_names, costs, sens, rejected),
                verify,
                deadline=tuning.deadline,
                max_trials=REFINE_TRIALS_PER_NODE * len(names) + 10,
                upgrades=lambda allocation: costlier_moves(allocation, option_names, costs, sens),
                restart_trials=len(names),
            )
        trials += refined.trials
        out_of_time = refined.out_of_time
    return trials, out_of_time


def _chosen(tuning: Tuning, trials: list[Trial]) -> tuple[Trial, bool]:
    """The best trial that meets the goal (met), or the closest one."""
    chosen = best_trial(trials, tuning.request.options.objective)
    if chosen is not None:
        return chosen, True
    if not trials:
        raise QtoolError(
            f"--time-budget {tuning.request.options.time_budget:g} s ran out before any candidate was verified",
            hint="give a larger --time-budget",
        )
    sign = -1 if tuning.goal.lower_is_better else 1
    return max(trials, key=lambda t: (t.metric if t.metric is not None else t.sqnr_db) * sign), False


def _write_chosen(
    tuning: Tuning, sens: Sensitivity, candidates: Candidates, trials: list[Trial], out_of_time: bool
) -> TuneResult:
    """Write the chosen config and its model (built as ``quantize --config`` builds it), then score what was written."""
    request = tuning.request
    chosen, met = _chosen(tuning, trials)
    document = allocation_document(tuning.ws.config.raw, tuning.op_types, chosen.allocation)
    header = (
        f"Chosen by qtool tune {__version__} for {request.model_path.name}: {tuning.goal.describe()}, "
        f"objective {request.options.objective}.\n"
        f"Reproduce: qtool quantize {request.model_path.name} --config {request.config_out.name} "
        f"--data {request.data_dir} -o OUT.onnx"
    )
    text = config_text(document, header)
    _quantize_as_configured(request, text)
    write_text(request.config_out, text)
    with stage("score the written model"):
        # The written model is built by quantize's own path: score it too, so the report states what was written.
        written = candidates.verify(onnx.load(str(request.output_path)), chosen.allocation, nsr(chosen.predicted_db))
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
        source=tuning.ws.source,
        output=ModelFile.of(request.output_path),
        config_out=str(request.config_out),
        objective=request.options.objective,
        goal=tuning.goal.describe(),
        nodes=len(tuning.tuned),
        trials=trials,
        chosen=chosen,
        written=written,
        met=met,
        out_of_time=out_of_time,
        sensitivity=sens,
        seconds=time.monotonic() - tuning.started,
        notes=notes,
    )


def _quantize_as_configured(request: TuneRequest, text: str) -> None:
    """Build and write the model of the chosen config exactly as ``qtool quantize --config CHOSEN --data`` does.

    Its own workspace: the chosen config's opset (and the weight algorithms' memory budget) can
    differ from the search's, and the promise is the byte-for-byte reproduction.
    """
    with tempfile.TemporaryDirectory(prefix="qtool-tune-") as scratch:
        built_from = Path(scratch) / request.config_out.name
        built_from.write_text(text)
        config = load_config(built_from).with_target(None)
        ws = open_workspace(request.model_path, config, DEFAULT_OUTPUT.opset, request.input_shapes)
        with stage(f"write {request.output_path}"), sample_directory(request.data_dir, "data") as data_dir:
            quantize(ws, _write_request(request, data_dir, built_from), None)


def _write_request(request: TuneRequest, data_dir: Path | str | None, config: Path) -> QuantizeRequest:
    return QuantizeRequest(
        output_path=request.output_path,
        stats_path=None,
        data_dir=data_dir,
        calibration=request.calibration,
        search=DEFAULT_SEARCH,
        evaluation=None,
        eval_dir=None,
        output=DEFAULT_OUTPUT,
        config_source=config,
        input_shapes=request.input_shapes,
    )
