"""The ``tune`` pipeline: one calibration, each node's sensitivity, allocations selected and validated, one written.

Calibrates once on the calibration samples and splits EVAL in two (:mod:`qtool.evaluation.split`):
a decoder's halves also hold the decode step after each prefill (:mod:`qtool.calibration.decode_steps`);
the selection half measures what each tuned node (every node with a constant weight) adds to the
output error at each precision its target allows, one node at a time, and verifies the
allocations made for a noise budget (see :mod:`qtool.choice.tune`); the validation half,
which no choice saw, scores the chosen allocation. The promise is the lower confidence bound of
that validated figure; when it misses the target, the selection raises its margin by the shortfall
and chooses again. Every candidate is built by the workspace's :class:`~qtool.pipeline.build.Builder`.
The chosen allocation is written as a QConfigDict and the model is built from it exactly as
``qtool quantize --config`` builds it, within the time budget (its cost is set aside before searching).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from qtool.calibration.dataset import Dataset
from qtool.calibration.decode_steps import with_decode_steps
from qtool.calibration.outputs import FloatOutputs
from qtool.choice.decode import DecodeJudge, decoder_to_score
from qtool.choice.tune.cache import cache_key, default_cache_dir, load_sensitivity, save_sensitivity
from qtool.choice.tune.candidates import Candidates, Halves
from qtool.choice.tune.metric import read_labels
from qtool.choice.tune.selection import VALIDATION_ROUNDS, noise_ceiling, search_and_validate, timed
from qtool.choice.tune.sensitivity import Sensitivity, measure
from qtool.choice.tune.space import (
    GPTQ_BC,
    MEASURED,
    Option,
    for_objective,
    options_for,
    without_algorithms,
)
from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.evaluation.judged import judged_outputs
from qtool.evaluation.scoring import OutputScorer
from qtool.evaluation.split import SampleSplit, output_energies, split_samples, spread_subset
from qtool.graph.prepare import default_opset
from qtool.graph.session import create_session
from qtool.options import TuneOptions
from qtool.pipeline.build import Builder, input_collector
from qtool.pipeline.calibrate import observe
from qtool.pipeline.data import full_dataset
from qtool.pipeline.tune_state import TuneRequest, Tuning
from qtool.pipeline.tune_write import write_chosen
from qtool.pipeline.workspace import Workspace, open_workspace
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.algorithms.rounding.weight_rounding import WeightAlgorithms
from qtool.quantization.plan.records import NodePlan, QuantPlan
from qtool.results import TuneResult
from qtool.system.environment import cpu_info, files_digest, versions
from qtool.system.stages import stage

SENSITIVITY_SHARE = 0.6  # of the time budget, at most, for measuring nodes one at a time


def tune(request: TuneRequest, config: QConfig, progress: ProgressFactory | None) -> TuneResult:
    """Tune ``request.model_path`` under ``config`` (see the module docstring)."""
    tuning = _prepare(request, config, progress, time.monotonic())
    with tempfile.TemporaryDirectory(prefix="qtool-decode-steps-") as scratch:
        judges = _decode_judges(tuning)
        return _tune(tuning, _scorers(tuning, Path(scratch)), judges, progress)


def _decode_judges(tuning: Tuning) -> tuple[DecodeJudge, DecodeJudge] | None:
    """A decode goal's float greedy decodes of the selection and of the validation token files (run once)."""
    steps = tuning.goal.decode_steps
    if steps is None:
        return None
    ws, threads = tuning.ws, tuning.request.options.threads
    decoder = decoder_to_score(ws.prepared)
    assert decoder is not None  # checked by _prepare
    with stage("decode the evaluation samples with the float model"):
        return (
            DecodeJudge(ws.prepared, ws.weights, decoder, tuning.split.selection, threads, steps),
            DecodeJudge(ws.prepared, ws.weights, decoder, tuning.split.validation, threads, steps),
        )


def _scorers(tuning: Tuning, scratch: Path) -> tuple[OutputScorer, OutputScorer]:
    """Scorers on the selection and validation halves; a decoder's also score the decode step after each prefill.

    Decode steps (see :mod:`qtool.calibration.decode_steps`) are left out when a metric or labels score
    each sample: those are per file.
    """
    ws, options = tuning.ws, tuning.request.options
    selection, validation = tuning.split.selection, tuning.split.validation
    known: FloatOutputs | None = tuning.evaluation.float_outputs()
    decoder = decoder_to_score(ws.prepared) if tuning.goal.labels is None and tuning.goal.metric is None else None
    if decoder is not None:
        session = create_session(ws.prepared, "the float model", threads=options.threads, weights=ws.weights)
        known = FloatOutputs()  # the prefills' float outputs, from the pass that writes the decode steps
        selection = with_decode_steps(selection, session, decoder, scratch / "selection", known)
        validation = with_decode_steps(validation, session, decoder, scratch / "validation", known)
    tuning.evaluation.release()

    def scorer(half: Dataset) -> OutputScorer:  # a streaming model's over sequences: closed-loop
        return OutputScorer(
            ws.prepared,
            half,
            threads=options.threads,
            weights=ws.weights,
            known=known,
            judged=tuning.judged,
            state=tuning.state,
        )

    return scorer(selection), scorer(validation)


def _tune(
    tuning: Tuning,
    scorers: tuple[OutputScorer, OutputScorer],
    judges: tuple[DecodeJudge, DecodeJudge] | None,
    progress: ProgressFactory | None,
) -> TuneResult:
    options = tuning.request.options
    ws = tuning.ws
    selection, validation = scorers
    sens = _sensitivity(tuning, selection, progress)
    labels = tuning.goal.labels
    split = tuning.split
    per_half = (
        ([labels[i] for i in split.selection_positions], [labels[i] for i in split.validation_positions])
        if labels is not None
        else (None, None)
    )
    halves = Halves(selection, validation, per_half, judges, split.validation_files, VALIDATION_ROUNDS)
    candidates = Candidates(
        ws.prepared,
        halves,
        ws.weights,
        ws.source.size_bytes,
        tuning.goal,
        timed=timed(options),
        latency_runs=options.latency_runs,
        threads=options.threads,
    )
    outcome = search_and_validate(tuning, sens, candidates, progress or noop_progress)
    return write_chosen(tuning, sens, candidates, outcome, progress)


def _check_decoder_goal(request: TuneRequest, ws: Workspace) -> None:
    """--target-decode only where there is a decode to run."""
    if request.goal.decode_steps is not None and decoder_to_score(ws.prepared) is None:
        raise QtoolError(
            f"{request.model_path}: --target-decode needs a decoder (input_ids in, logits and its present key/value "
            "cache out) to run a greedy decode through",
            hint="judge other models with --target-sqnr DB or --metric module:function",
        )


def _tuned_nodes(ws: Workspace, plan: QuantPlan, model_path: Path) -> tuple[list[NodePlan], dict[str, list[int]]]:
    """The nodes tune allocates (largest weight first; those inside If/Loop/Scan bodies too) and their weight shapes.

    Raises:
        QtoolError: no node has a constant weight.
    """
    shapes = {init.name: list(init.dims) for init in ws.prepared.graph.initializer}
    for body in plan.every_branch():  # a body's own weights (its nodes are tuned by name like any other)
        shapes.update({init.name: list(init.dims) for init in body.model.graph.initializer})
    weight_shape = {n.name: shapes[n.weight.name] for n in plan.every_node() if n.weight is not None}
    tuned = sorted(
        (n for n in plan.every_node() if n.name in weight_shape),
        key=lambda n: (-int(np.prod(weight_shape[n.name])), n.name),
    )
    if not tuned:
        raise QtoolError(f"{model_path} has no node with a constant weight to tune")
    return tuned, weight_shape


def _prepare(request: TuneRequest, config: QConfig, progress: ProgressFactory | None, started: float) -> Tuning:
    """The workspace at the widest option's opset, calibrated once (with the GPTQ inputs when the space has GPTQ)."""
    space = for_objective(options_for(config.target), timed(request.options))
    # Candidates are built at the opset the widest option needs (int2 weights: 25), so each one loads; a newer
    # model keeps its own (as quantize does: lowering it can fail where nothing needs it lower)
    widest = max(config.with_rules(global_=o.entry).opset_requirement()[0] for o in space if o.entry)
    ws = open_workspace(request.model_path, config, None, request.input_shapes, at_least=(widest, "tune's precisions"))
    opset = default_opset(ws.prepared)
    _check_decoder_goal(request, ws)
    evaluation_scorer, split = _split_eval(ws, request)
    named = request.options.outputs or config.accuracy.outputs
    source = "--outputs" if request.options.outputs else "accuracy.outputs"
    judged = judged_outputs(ws.prepared, named, source, config.accuracy.state)
    # GPTQ options need each node's calibration inputs, and those with bias correction its mean patches: gathered
    # in the same float pass (within the collector's memory budget; nodes past it are rounded to nearest, as
    # quantize would)
    wants_inputs = len(without_algorithms(space)) < len(space)
    collector = input_collector(ws, config.with_rules(global_=GPTQ_BC)) if wants_inputs else None
    stats = observe(ws, request.data_dir, request.calibration, progress, inputs=collector)
    algorithms = WeightAlgorithms(collector.result) if collector is not None else None
    if algorithms is None:
        space = without_algorithms(space)
    builder = Builder(ws, stats, algorithms)
    plan = builder.plan(config)
    tuned, weight_shape = _tuned_nodes(ws, plan, request.model_path)
    # Each node is measured on selection samples of EVAL, where the target is judged: calibration samples
    # can miss the inputs that break a model (PP-OCRv4 det, one int8 layer alone: 46 dB on four CALIB crops,
    # 35 dB on the EVAL crops, where sparse text makes every stray pixel count).
    spread = spread_subset(split.selection, request.options.sensitivity_samples)
    count = len(evaluation_scorer.samples)
    labels = read_labels(request.options.labels, count) if request.options.labels is not None else None
    goal = replace(request.goal, labels=labels, confidence=request.options.confidence)
    op_types = {n.op_type for n in plan.every_node()}
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
        evaluation_scorer,
        spread,
        opset,
        started,
        prepare_seconds,
        judged=judged.subset,
        state=judged.state,
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
    scorer = OutputScorer(ws.prepared, evaluation, threads=request.options.threads, weights=ws.weights)
    return scorer, split_samples(evaluation, output_energies(scorer.signal))


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
            "noise_ceiling": noise_ceiling(tuning.goal),  # int2 is measured only where int4 fits it
            "nodes": tuning.names,
            "threads": request.options.threads,
            # the outputs the goal judges, when not all (left out otherwise: earlier measurements stay valid)
            **({"judged": sorted(tuning.judged)} if tuning.judged is not None else {}),
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
            ws.prepared,
            tuning.spread,
            threads=options.threads,
            weights=ws.weights,
            known=selection.float_outputs(),
            judged=tuning.judged,
            state=tuning.state,
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
                budget=noise_ceiling(tuning.goal),
            )
        scorer.release()
        if cache_dir is not None:
            sens.cache_file = save_sensitivity(cache_dir, key, sens)
    sens.samples = [path.name for path in tuning.spread.files]  # in the cache key: the same files when read back
    sens.nodes = len(tuning.names)
    return sens


def _cache_dir(options: TuneOptions) -> Path | None:
    """Where tune keeps its measurements (None: --no-cache, or no folder to use)."""
    if not options.cache:
        return None
    return Path(options.cache_dir) if options.cache_dir is not None else default_cache_dir()
