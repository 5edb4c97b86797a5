"""The ``tune`` pipeline: one calibration, each node's sensitivity, allocations selected and validated, one written.

Calibrates once on the calibration samples and splits EVAL in two (:mod:`qtool.evaluation.split`):
the selection half measures what each tuned node (every node with a constant weight) adds to the
output error at each precision its target allows, one node at a time, and verifies the
allocations made for a noise budget (see :mod:`qtool.quantization.tune`); the validation half,
which no choice saw, scores the chosen allocation. The promise is the lower confidence bound of
that validated figure; when it misses the target, the selection raises its margin by the shortfall
and chooses again. Every candidate is built by the workspace's :class:`~qtool.pipeline.build.Builder`.
The chosen allocation is written as a QConfigDict and the model is built from it exactly as
``qtool quantize --config`` builds it, within the time budget (its cost is set aside before searching).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
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
from qtool.evaluation.split import SampleSplit, output_energies, split_samples, spread_subset
from qtool.graph.model_io import write_text
from qtool.options import DEFAULT_OUTPUT, DEFAULT_SEARCH, CalibrationOptions, TuneOptions
from qtool.pipeline.build import Builder, input_collector
from qtool.pipeline.calibrate import observe
from qtool.pipeline.data import full_dataset
from qtool.pipeline.quantize import QuantizeRequest, quantize
from qtool.pipeline.workspace import Workspace, open_workspace
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.algorithms.weight_rounding import WeightAlgorithms
from qtool.quantization.plan_types import NodePlan
from qtool.quantization.tune.allocation import allocate, cheaper_moves, costlier_moves, predicted_nsr
from qtool.quantization.tune.cache import cache_key, default_cache_dir, load_sensitivity, save_sensitivity
from qtool.quantization.tune.candidates import Candidates, Goal, Validation, ValidationRound, node_costs
from qtool.quantization.tune.configs import allocation_document, config_text
from qtool.quantization.tune.loop import Margins, Search, Trial, best_trial, refine, search_budgets
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

REFINE_TRIALS_PER_NODE = 3  # verifications the refinement (descent and restarts) may spend, per tuned node
SENSITIVITY_SHARE = 0.6  # of the time budget, at most, for measuring nodes one at a time
FIRST_METRIC_BUDGET = 1e-3  # noise-to-signal power to start from with a metric goal (30 dB)
VALIDATION_ROUNDS = 5  # choices validated at most (each bound is at the confidence corrected for them all)
MARGIN_STEP_DB = 0.25  # added to an SQNR shortfall, so the next choice is not the one that just missed
MARGIN_RESOLUTION_DB = 0.5  # the margin's bisection stops when the passing and missing margins are this close
FINAL_BUILD_SHARE = 1.5  # the final build (calibration again) is set aside as this many times the first one


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
    split: SampleSplit  # EVAL: the selection half chooses, the validation half judges the choice
    evaluation: OutputScorer  # all of EVAL's float outputs (the halves' scorers take theirs from it)
    spread: Dataset  # samples of the selection half each node is measured on
    opset: int  # the widest option's: every candidate is built at it
    started: float
    prepare_seconds: float  # calibration (and the GPTQ inputs): the final build does it again

    @property
    def deadline(self) -> float:
        """When the search must stop: the budget less what the final build will take."""
        return self.started + self.request.options.time_budget - FINAL_BUILD_SHARE * self.prepare_seconds

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


@dataclass
class Outcome:
    """What the search and the validation found."""

    trials: list[Trial]
    chosen: Trial
    validation: Validation  # of the chosen candidate
    rounds: list[ValidationRound]
    margin: float  # the selection margin the last choice was made with (goal units)
    out_of_time: bool
    stalled: bool
    reachable: bool  # some quantized candidate met the target on the selection samples


def tune(request: TuneRequest, config: QConfig, progress: ProgressFactory | None) -> TuneResult:
    """Tune ``request.model_path`` under ``config`` (see the module docstring)."""
    tuning = _prepare(request, config, progress, time.monotonic())
    options = request.options
    ws = tuning.ws
    known = tuning.evaluation.float_outputs()
    scorers = [
        OutputScorer(ws.prepared, half, threads=options.threads, weights=ws.weights, known=known)
        for half in (tuning.split.selection, tuning.split.validation)
    ]
    tuning.evaluation.release()
    selection, validation = scorers
    sens = _sensitivity(tuning, selection, progress)
    labels = tuning.goal.labels
    candidates = Candidates(
        ws.prepared,
        selection,
        validation,
        ws.weights,
        ws.source.size_bytes,
        tuning.goal,
        timed=_timed(options),
        latency_runs=options.latency_runs,
        threads=options.threads,
        labels=(
            (
                [labels[i] for i in tuning.split.selection_positions],
                [labels[i] for i in tuning.split.validation_positions],
            )
            if labels is not None
            else (None, None)
        ),
        validations=VALIDATION_ROUNDS,
    )
    outcome = _search_and_validate(tuning, sens, candidates, progress or noop_progress)
    return _write_chosen(tuning, sens, candidates, outcome, progress)


def _timed(options: TuneOptions) -> bool:
    return options.objective == "latency" or options.max_latency_ratio is not None


def _prepare(request: TuneRequest, config: QConfig, progress: ProgressFactory | None, started: float) -> Tuning:
    """The workspace at the widest option's opset, calibrated once (with the GPTQ inputs when the space has GPTQ)."""
    space = for_objective(options_for(config.target), _timed(request.options))
    # Candidates are built at the opset the widest option needs (int2 weights: 25), so each one loads.
    opset = max(config.with_rules(global_=o.entry).opset_requirement()[0] for o in space if o.entry)
    ws = open_workspace(request.model_path, config, opset, request.input_shapes)
    float_outputs, split = _split_eval(ws, request)
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
    # Each node is measured on selection samples of EVAL, where the target is judged: calibration samples
    # can miss the inputs that break a model (PP-OCRv4 det, one int8 layer alone: 46 dB on four CALIB crops,
    # 35 dB on the EVAL crops, where sparse text makes every stray pixel count).
    spread = spread_subset(split.selection, request.options.sensitivity_samples)
    count = len(float_outputs.samples)
    labels = read_labels(request.options.labels, count) if request.options.labels is not None else None
    goal = replace(request.goal, labels=labels, confidence=request.options.confidence)
    op_types = {n.op_type for n in plan.nodes}
    prepare_seconds = time.monotonic() - started
    return Tuning(
        request,
        ws,
        builder,
        space,
        tuned,
        weight_shape,
        op_types,
        goal,
        split,
        float_outputs,
        spread,
        opset,
        started,
        prepare_seconds,
    )


def _split_eval(ws: Workspace, request: TuneRequest) -> tuple[OutputScorer, SampleSplit]:
    """EVAL's float outputs (computed once, every scorer reuses them) and its halves, matched on them."""
    evaluation = full_dataset(ws, request.eval_dir)
    if len(evaluation) < 2:
        raise QtoolError(
            f"{request.eval_dir} holds {len(evaluation)} sample: tune selects on half of EVAL and validates "
            "its choice on the other half",
            hint="give EVAL at least 2 samples (8 or more for a useful confidence bound)",
        )
    float_outputs = OutputScorer(ws.prepared, evaluation, threads=request.options.threads, weights=ws.weights)
    return float_outputs, split_samples(evaluation, output_energies(float_outputs.signal))


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
            "noise_ceiling": _noise_ceiling(tuning.goal),  # int2 is measured only where int4 fits it
            "nodes": tuning.names,
            "threads": request.options.threads,
        }
    )


def _sensitivity(tuning: Tuning, selection: OutputScorer, progress: ProgressFactory | None) -> Sensitivity:
    """Each node's noise at each option, alone: from the cache, or measured (and cached)."""
    options = tuning.request.options
    cache_dir = _cache_dir(options)
    key = _cache_key(tuning) if cache_dir is not None else ""
    space = [o.name for o in tuning.space]
    sens = load_sensitivity(cache_dir, key, tuning.names, space) if cache_dir is not None else None
    if sens is None:
        ws = tuning.ws
        scorer = OutputScorer(
            ws.prepared, tuning.spread, threads=options.threads, weights=ws.weights, known=selection.float_outputs()
        )

        def isolated_sqnr(selection: dict[str, Option]) -> float:
            return scorer.score(tuning.build(selection), "a node alone").worst_db

        with stage(f"sensitivity of {len(tuning.tuned)} nodes"):
            measured = len(tuning.tuned) * len([o for o in tuning.space if o.name in MEASURED])
            sens = measure(
                tuning.names,
                tuning.space,
                isolated_sqnr,
                deadline=tuning.started + SENSITIVITY_SHARE * (tuning.deadline - tuning.started),
                advance=(progress or noop_progress)("sensitivity", measured),
                budget=_noise_ceiling(tuning.goal),
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


def _search(
    tuning: Tuning,
    sens: Sensitivity,
    candidates: Candidates,
    verify: Callable[[dict[str, str]], Trial],
    known: Sequence[Trial] = (),
    refine_trials: int = REFINE_TRIALS_PER_NODE,
) -> Search:
    """Allocations for a shrinking noise budget, verified; then the best one refined (size objective).

    ``known``: trials verified before (judged under the current goal): the refinement starts from the
    best of them and the new ones. ``refine_trials``: verifications the refinement may spend per node.
    """
    options, goal, names = tuning.request.options, candidates.goal, tuning.names
    option_names = [o.name for o in tuning.space]
    costs = _costs(tuning)
    first = _first_budget(goal)
    search = Search()
    tiers = [option_names]
    if _timed(options):  # low-bit weight-only nodes dequantize at run time: the fallback tier runs at float speed
        tiers.append([o for o in option_names if o not in ("w2", "w4")])
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
            search.trials += found.trials
            search.out_of_time = search.out_of_time or found.out_of_time
            if best_trial(search.trials, options.objective) is not None or search.out_of_time:
                break
    best = best_trial([*known, *search.trials], options.objective)
    if best is not None and options.objective == "size" and not search.out_of_time:
        with stage("refine the best allocation"):
            refined = refine(
                best,
                lambda allocation, rejected: cheaper_moves(allocation, option_names, costs, sens, rejected),
                verify,
                deadline=tuning.deadline,
                max_trials=refine_trials * len(names) + 10,
                upgrades=lambda allocation: costlier_moves(allocation, option_names, costs, sens),
                restart_trials=len(names),
                stall_trials=max(8, len(names) // 4),
            )
        search.trials += refined.trials
        search.out_of_time, search.stalled = refined.out_of_time, refined.stalled
    return search


def _first_budget(goal: Goal) -> float:
    """The noise budget an SQNR goal (and its margin) allows; a metric goal's first guess (30 dB)."""
    return nsr(goal.target_sqnr_db + goal.margin_db) if goal.target_sqnr_db is not None else FIRST_METRIC_BUDGET


def _noise_ceiling(goal: Goal) -> float:
    """The most noise any allocation meeting the goal can have (an SQNR goal's budget; unknown for a metric)."""
    return nsr(goal.target_sqnr_db) if goal.target_sqnr_db is not None else math.inf


def _costs(tuning: Tuning) -> dict[str, dict[str, float]]:
    """Each node's predicted cost of each option (bytes, or time for the latency objective)."""
    return node_costs(
        tuning.names,
        tuning.weight_shape,
        {n.name: n.weight.axis if n.weight is not None else None for n in tuning.tuned},
        _block_axes(tuning),
        {n.name: n.macs or 0 for n in tuning.tuned},
        tuning.request.options.objective,
        [o.name for o in tuning.space],
        lambda o: OPTIONS[o].integer,
    )


def _search_and_validate(
    tuning: Tuning, sens: Sensitivity, candidates: Candidates, progress: ProgressFactory
) -> Outcome:
    """Select on the selection half, validate the choice on the other; a miss raises the margin and chooses again."""
    objective = tuning.request.options.objective
    verified: dict[tuple[tuple[str, str], ...], Trial] = {}
    advance = progress("candidates", REFINE_TRIALS_PER_NODE * len(tuning.names) + 30)

    def verify(allocation: dict[str, str]) -> Trial:
        key = tuple(sorted(allocation.items()))
        if key not in verified:
            model = tuning.build(allocation)
            verified[key] = candidates.verify(model, allocation, predicted_nsr(allocation, sens))
            advance(1)
        return candidates.judged(verified[key])

    search = _search(tuning, sens, candidates, verify)
    trials, out_of_time, stalled = list(search.trials), search.out_of_time, search.stalled
    reachable = best_trial(trials, objective) is not None
    if not reachable and not any(_quantizes(t) for t in trials):  # the target asks for more than any option gives
        trials.append(verify(_most_accurate_quantized(tuning, sens)))
    choice = _validate_choices(tuning, sens, candidates, verify, trials, reachable)
    return Outcome(
        choice.trials,
        choice.chosen,
        choice.validation,
        choice.rounds,
        choice.margin,
        out_of_time or choice.out_of_time,
        stalled,
        reachable,
    )


@dataclass
class _Validated:
    """The validation loop's result: the trials (some added), the kept choice and every round."""

    trials: list[Trial]
    chosen: Trial
    validation: Validation
    margin: float
    rounds: list[ValidationRound]
    out_of_time: bool


def _validate_choices(
    tuning: Tuning,
    sens: Sensitivity,
    candidates: Candidates,
    verify: Callable[[dict[str, str]], Trial],
    trials: list[Trial],
    reachable: bool,
) -> _Validated:
    """Validate the choice; move the selection margin (see :class:`Margins`) and choose again, up to the limit."""
    objective = tuning.request.options.objective
    out_of_time = False
    margins = Margins(MARGIN_STEP_DB, MARGIN_RESOLUTION_DB)
    searched = {0.0}  # margins searched at (the first search's)
    validated: dict[tuple[tuple[str, str], ...], Validation] = {}
    rounds: list[ValidationRound] = []
    kept: tuple[Trial, Validation, float] | None = None  # the best choice whose validation met the goal
    with stage("validate the choice"):
        while margins.margin is not None:
            margin = margins.margin
            candidates.goal = replace(tuning.goal, margin_db=margin)
            trials = [candidates.judged(t) for t in trials]
            if reachable and margin not in searched and time.monotonic() < tuning.deadline:
                # a new margin: allocate for its budget and refine, so the choice there is as small as the first
                more = _search(tuning, sens, candidates, verify, trials, refine_trials=1)
                trials += [t for t in more.trials if t not in trials]
                out_of_time = out_of_time or more.out_of_time
                searched.add(margin)
            chosen = best_trial(trials, objective) or (None if rounds else _closest(tuning, trials))
            if chosen is None:
                break
            key = tuple(sorted(chosen.allocation.items()))
            if key not in validated:
                if len(rounds) >= VALIDATION_ROUNDS or (rounds and time.monotonic() > tuning.deadline):
                    break
                validated[key] = candidates.validate(tuning.build(chosen.allocation))
                rounds.append(ValidationRound(trials.index(chosen), margin, validated[key]))
            validation = validated[key]
            if validation.meets and chosen.meets and (kept is None or _better(chosen, kept[0], objective)):
                kept = (chosen, validation, margin)
            if not chosen.meets:  # the target is out of reach: the most accurate quantized candidate, validated
                kept = kept or (chosen, validation, margin)
                break
            shortfall = tuning.goal.shortfall(validation.bound_db, validation.metric_bound)
            margins.update(validation.meets, shortfall, bisect=tuning.goal.metric is None)
    if kept is None:  # every validated choice missed: the last one, reported as missing
        last = rounds[-1]
        kept = (trials[last.trial], last.validation, last.margin)
    chosen, validation, margin = kept
    candidates.goal = replace(tuning.goal, margin_db=margin)  # the trials as judged when the kept one was chosen
    trials = [candidates.judged(t) for t in trials]
    chosen = next(t for t in trials if t.allocation == chosen.allocation)
    return _Validated(trials, chosen, validation, margin, rounds, out_of_time)


def _better(trial: Trial, than: Trial, objective: str) -> bool:
    """Whether ``trial`` is preferred to ``than`` (both meeting the goal) under the objective."""
    return best_trial([than, trial], objective) is trial


def _quantizes(trial: Trial) -> bool:
    return any(option != "float" for option in trial.allocation.values())


def _most_accurate_quantized(tuning: Tuning, sens: Sensitivity) -> dict[str, str]:
    """Each node's least noisy option other than float (the cheaper of equals): the best a quantized model does."""
    costs = _costs(tuning)
    usable = [o.name for o in tuning.space if o.name != "float"]
    chosen = {}
    for node in tuning.names:
        ranked = sorted((sens.of(node, o), costs[node][o], o) for o in usable)
        chosen[node] = ranked[0][2]
    return chosen


def _closest(tuning: Tuning, trials: list[Trial]) -> Trial:
    """When no trial meets the target: the most accurate one that quantizes something."""
    quantized = [t for t in trials if _quantizes(t)] or trials
    if not quantized:
        raise QtoolError(
            f"--time-budget {tuning.request.options.time_budget:g} s ran out before any candidate was verified",
            hint="give a larger --time-budget",
        )
    sign = -1 if tuning.goal.lower_is_better else 1
    return max(quantized, key=lambda t: (t.metric_bound if t.metric_bound is not None else t.bound_db) * sign)


def _write_chosen(
    tuning: Tuning, sens: Sensitivity, candidates: Candidates, outcome: Outcome, progress: ProgressFactory | None
) -> TuneResult:
    """Write the chosen config and its model (built as ``quantize --config`` builds it), then score what was written."""
    request = tuning.request
    chosen = outcome.chosen
    document = allocation_document(tuning.ws.config.raw, tuning.op_types, chosen.allocation)
    header = (
        f"Chosen by qtool tune {__version__} for {request.model_path.name}: {tuning.goal.describe()}, "
        f"objective {request.options.objective}.\n"
        f"Reproduce: qtool quantize {request.model_path.name} --config {request.config_out.name} "
        f"--data {request.data_dir} -o OUT.onnx"
    )
    text = config_text(document, header)
    _quantize_as_configured(request, text, progress)
    write_text(request.config_out, text)
    with stage("score the written model"):
        # The written model is built by quantize's own path: score it too, so the report states what was written.
        model = onnx.load(str(request.output_path), format="protobuf")
        candidates.goal = replace(tuning.goal, margin_db=outcome.margin)
        written = candidates.verify(model, chosen.allocation, nsr(chosen.predicted_db))
        validation = candidates.validate(model)
    met = validation.meets and outcome.reachable and chosen.meets
    if written.note.startswith("slower"):
        met = False
    notes = _notes(outcome, validation, sens)
    return TuneResult(
        source=tuning.ws.source,
        output=ModelFile.of(request.output_path),
        config_out=str(request.config_out),
        objective=request.options.objective,
        goal=tuning.goal.describe(),
        target_sqnr_db=tuning.goal.target_sqnr_db,
        nodes=len(tuning.tuned),
        trials=outcome.trials,
        chosen=chosen,
        written=written,
        validation=validation,
        rounds=outcome.rounds,
        margin=outcome.margin,
        confidence=tuning.goal.confidence,
        validation_confidence=candidates.validation_confidence,
        selection_samples=tuning.split.selection_files,
        met=met,
        reachable=outcome.reachable,
        out_of_time=outcome.out_of_time,
        stalled=outcome.stalled,
        sensitivity=sens,
        seconds=time.monotonic() - tuning.started,
        time_budget=request.options.time_budget,
        notes=notes,
    )


def _notes(outcome: Outcome, written: Validation, sens: Sensitivity) -> list[str]:
    """What the report should point out: a written model that validates worse than its candidate, a cut measurement."""
    notes = []
    if outcome.validation.meets and not written.meets:
        notes.append(
            f"the written model's validated bound is {written.bound_db:.2f} dB where its candidate's was "
            f"{outcome.validation.bound_db:.2f} dB: it misses the target"
        )
    if not sens.complete:
        notes.append(
            "the time budget cut the sensitivity measurement short: unmeasured nodes use the worst measured figures"
        )
    return notes


def _quantize_as_configured(request: TuneRequest, text: str, progress: ProgressFactory | None) -> None:
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
            quantize(ws, _write_request(request, data_dir, built_from), progress)


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
