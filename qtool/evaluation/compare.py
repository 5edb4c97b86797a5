"""compare(): a candidate model against its reference on samples - accuracy, latency per provider, gates."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from qtool.calibration.dataset import Dataset, model_inputs
from qtool.calibration.decoder import model_decoder
from qtool.calibration.outputs import FloatOutputs
from qtool.config import QConfig, load_config
from qtool.errors import QtoolError
from qtool.evaluation.baseline import Snapshot, StaleBaselineError, against_baseline, read_baseline, regression_gates
from qtool.evaluation.clipped_inputs import clipped_inputs, quantized_input_ranges
from qtool.evaluation.closed_loop import closed_loop_score
from qtool.evaluation.comparison import ComparisonResult
from qtool.evaluation.gates import DEFAULT_LATENCY_TOLERANCE, Gate, check_measurable, evaluate_gates
from qtool.evaluation.judged import judged_outputs
from qtool.evaluation.language_model import MAX_DECODE_STEPS, language_model_metrics
from qtool.evaluation.latency_runs import confirmed_latency_gates, latency_per_provider, requested_providers
from qtool.evaluation.layers import layer_errors
from qtool.evaluation.metrics import TASKS, output_metrics
from qtool.evaluation.opened import OpenedModel
from qtool.evaluation.output_kinds import output_sources
from qtool.evaluation.providers import session_providers
from qtool.graph.input_shapes import fix_input_shapes
from qtool.graph.session import create_session
from qtool.options import (
    DEFAULT_EVALUATION,
    EvaluationOptions,
)
from qtool.progress import ProgressFactory, noop_progress
from qtool.schemas.reports import CompareReport
from qtool.schemas.reports.compare import LanguageModel, Latency
from qtool.system.environment import cpu_info, files_digest, versions
from qtool.system.stages import stage

log = logging.getLogger(__name__)


def compare(
    reference_path: Path | str | OpenedModel,
    candidate_path: Path | str | OpenedModel,
    data_dir: Path | str,
    *,
    options: EvaluationOptions = DEFAULT_EVALUATION,
    config_path: Path | str | Mapping[str, Any] | QConfig | None = None,
    gates: list[Gate] | None = None,
    progress: ProgressFactory | None = None,
    known: FloatOutputs | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    baseline: Path | str | None = None,
    fail_on_regression: bool = False,
) -> ComparisonResult:
    """Compare a candidate model with its reference: size, accuracy, latency per provider, and gates.

    Args:
        reference_path: the float model (or the model already open, as ``quantize`` holds it).
        candidate_path: the quantized model (likewise).
        data_dir: evaluation samples for both models.
        options: runs, warm-up, threads, sample limit, NaN handling, task ("auto": top-1/top-5 for
            outputs that hold class scores, see :mod:`qtool.evaluation.output_kinds`), per-layer
            pairing, providers (unavailable ones are skipped).
        config_path: a QConfigDict whose ``preprocess:`` block turns images into inputs (or the config as
            ``quantize`` holds it, loaded).
        gates: thresholds to judge (see :mod:`qtool.evaluation.gates`).
        progress: receives progress updates.
        known: the float model's outputs that calibration kept for some of these
            samples (``quantize --data``): those samples do not run the reference again.
        input_shapes: input name -> sizes fixing its dynamic dimensions other than batch: samples of
            another shape are refused, so accuracy and latency are measured at that shape.
        baseline: an earlier ``compare --json`` report: the result also holds the change against it
            (see :mod:`qtool.evaluation.baseline`), read and checked before any work.
        fail_on_regression: with ``baseline``, each compared number is also a gate that a regression fails.
    """
    earlier = _checked(options, gates or [], baseline, fail_on_regression)
    models = tuple(m if isinstance(m, OpenedModel) else OpenedModel.read(m) for m in (reference_path, candidate_path))
    if options.per_layer:  # each model runs whole, every tensor exposed
        models = tuple(m.whole() for m in models)
    reference, candidate = models
    config = config_path if isinstance(config_path, QConfig) else load_config(config_path) if config_path else None
    options = _gate_outputs(reference.graph, options, config)
    dataset = _dataset((reference, candidate), data_dir, options, config, input_shapes)
    result = _measured((reference, candidate), dataset, options, progress, known)
    _say_clipped_inputs(candidate, dataset, known)
    reproducibility = _reproducibility(dataset, config, options, result.latency)
    result = replace(result, data_dir=str(data_dir), reproducibility=reproducibility)
    judged = evaluate_gates(gates or [], result.measured(), result.intervals())
    paths, factory = (reference.path, candidate.path), progress or noop_progress
    judged = confirmed_latency_gates(gates or [], judged, result.primary_latency, paths, dataset, options, factory)
    if earlier is None:
        return replace(result, gates=judged)
    stated = [g.tolerance for g in gates or [] if g.metric == "latency_ratio"]
    tolerance = max(stated, default=DEFAULT_LATENCY_TOLERANCE)
    changes = against_baseline(_snapshot(result), earlier, str(baseline), tolerance)
    if not changes.same_reference:
        log.warning("the baseline %s measured another reference model (its digest differs)", baseline)
    if fail_on_regression:
        judged += regression_gates(changes)
    return replace(result, gates=judged, baseline=changes)


def _say_clipped_inputs(candidate: OpenedModel, dataset: Dataset, known: FloatOutputs | None) -> None:
    """Warn of samples past the candidate's quantized input ranges (not on its calibration samples: ``known``)."""
    if known is not None:
        return
    for clipped in clipped_inputs(quantized_input_ranges(candidate.graph), (f for _, f in dataset.samples())):
        log.warning("%s", clipped.sentence(str(candidate.path), str(dataset.directory)))


def _checked(
    options: EvaluationOptions, gates: list[Gate], baseline: Path | str | None, fail_on_regression: bool
) -> CompareReport | None:
    """Refuse settings that cannot mean anything before any work; the baseline report, read and checked."""
    if options.runs < 0 or options.warmup < 0:
        raise QtoolError("--runs and --warmup must be >= 0")
    if options.threads is not None and options.threads < 1:
        raise QtoolError("--threads must be >= 1")
    if options.task not in TASKS:
        raise QtoolError(f"unknown task '{options.task}'", hint=f"use one of: {', '.join(TASKS)}")
    if not 0 <= options.decode_steps <= MAX_DECODE_STEPS:
        raise QtoolError(f"--decode-steps must be an integer from 0 to {MAX_DECODE_STEPS}")
    check_measurable(gates, runs=options.runs, task=options.task, decode_steps=options.decode_steps)
    if fail_on_regression and baseline is None:
        raise QtoolError("--fail-on-regression needs --baseline REPORT.json")
    try:
        return read_baseline(baseline) if baseline is not None else None
    except StaleBaselineError as e:
        if fail_on_regression:  # a gate on it cannot be judged: the user must accept the change on purpose
            raise
        # shown for information only: a report of another qtool version is passed over, so that an accepted
        # change (a qtool upgrade) can write the report that replaces it
        log.warning("%s: not compared with this report (%s)", e.message, e.hint)
        return None


def _gate_outputs(reference: onnx.ModelProto, options: EvaluationOptions, config: QConfig | None) -> EvaluationOptions:
    """``options`` with the outputs the gates judge: as given, else the config's ``accuracy.outputs`` (checked here)."""
    outputs = options.outputs or (config.accuracy.outputs if config is not None else ())
    state = options.state or (config.accuracy.state if config is not None else ())
    source = "--outputs" if options.outputs or config is None else f"{config.source}: accuracy.outputs"
    judged_outputs(reference, outputs, source, state)  # a name that is no output or input: refused before any work
    return replace(options, outputs=outputs, state=state)


def _dataset(
    models: tuple[OpenedModel, OpenedModel],
    data_dir: Path | str,
    options: EvaluationOptions,
    config: QConfig | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
) -> Dataset:
    """The samples both models read (their inputs must agree), at the fixed input shapes when given."""
    (reference_path, reference_model), (candidate_path, candidate_model) = ((m.path, m.graph) for m in models)
    if input_shapes:  # the samples must have these shapes: accuracy and latency at the shape that ships
        fixed = onnx.ModelProto()
        fixed.CopyFrom(reference_model)
        fix_input_shapes(fixed, input_shapes, str(reference_path))
        inputs = model_inputs(fixed)
    else:
        inputs = model_inputs(reference_model)
    candidate_inputs = {i.name: i.dtype for i in model_inputs(candidate_model)}
    decoder = model_decoder(candidate_model)
    cache = {c.past for c in decoder.cache} if decoder is not None else set()  # may be stored int8 (kv_cache)
    same_types = all(candidate_inputs.get(i.name) == i.dtype or i.name in cache for i in inputs)
    if {i.name for i in inputs} != set(candidate_inputs) or not same_types:
        raise QtoolError(
            f"{candidate_path} and {reference_path} have different inputs",
            hint="compare a quantized model with the float model it came from",
        )
    preprocess = config.preprocess if config is not None else None
    return Dataset(data_dir, inputs, limit=options.limit, preprocess=preprocess, skip_nonfinite=options.skip_nonfinite)


def _measured(
    models: tuple[OpenedModel, OpenedModel],
    dataset: Dataset,
    options: EvaluationOptions,
    progress: ProgressFactory | None,
    known: FloatOutputs | None,
) -> ComparisonResult:
    """Accuracy (per output, per layer when asked) and latency on each provider."""
    (reference_path, reference_model), (candidate_path, candidate_model) = ((m.path, m.graph) for m in models)
    threads, factory = options.threads, progress or noop_progress
    reference, candidate = (m.cpu_session(threads) for m in models)
    judged = judged_outputs(reference_model, options.outputs, pairs=options.state)
    with stage(f"accuracy on {len(dataset)} samples"):
        accuracy = output_metrics(
            reference,
            candidate,
            dataset,
            output_sources(reference_model),
            factory("accuracy", len(dataset)),
            task=options.task,
            known=known,
            judged=judged.subset,
        )
    language = _language_model((reference_model, candidate_model), (reference, candidate), dataset, options, factory)
    loop = None
    if judged.state:
        with stage("closed loop over the sequences"):
            loop = closed_loop_score((reference, candidate), dataset, judged.state, list(judged.judged))
    layers = None
    if options.per_layer:
        with stage("per-layer error"):
            layers = layer_errors(reference_model, candidate_model, dataset, threads=threads, progress=factory)
    with stage(f"latency ({options.runs} runs per model and provider)"):
        latency, skipped = latency_per_provider(reference_path, candidate_path, dataset, options, factory)
    latency = [_provider_accuracy(lat, reference, candidate_path, dataset, threads, options) for lat in latency]
    return ComparisonResult(
        models[0].file,
        models[1].file,
        str(dataset.directory),  # the caller names the data as it was given
        accuracy.samples,
        accuracy.outputs,
        accuracy.overall,
        latency,
        skipped,
        accuracy.agreement,
        accuracy.task_note,
        layers,
        output_kinds=accuracy.kinds,
        boxes=accuracy.boxes,
        language_model=language,
        closed_loop=loop,
        judged=accuracy.judged,
        judged_note=judged.note([m.name for m in accuracy.judged_parts]),
        judged_parts=accuracy.judged_parts,
    )


def _language_model(
    models: tuple[onnx.ModelProto, onnx.ModelProto],
    sessions: tuple[ort.InferenceSession, ort.InferenceSession],
    dataset: Dataset,
    options: EvaluationOptions,
    factory: ProgressFactory,
) -> LanguageModel | None:
    """A decoder's perplexity, next-token and decode agreement; None for any other model."""
    reference, candidate = model_decoder(models[0]), model_decoder(models[1])
    if reference is None or candidate is None or reference.logits is None or candidate.logits is None:
        return None
    steps = options.decode_steps if all(c.present for c in (*reference.cache, *candidate.cache)) else 0
    if steps < options.decode_steps:
        log.warning("the decode loop is skipped: an output returning each cache input was not found")
    with stage(f"language model on {len(dataset)} samples ({steps} decode steps each)"):
        score = language_model_metrics(
            sessions[0],
            sessions[1],
            (reference, candidate),
            dataset,
            steps=steps,
            on_progress=factory("decode", len(dataset)),
        )
    if score.tokens == 0:
        log.warning(
            "%s: every sample holds a single token (a decode step with its past): no perplexity to score, the "
            "outputs are compared by their errors (give token files of 2 or more tokens for the decoder's figures)",
            dataset.directory,
        )
        return None
    return score


def _snapshot(result: ComparisonResult) -> Snapshot:
    """The numbers a baseline report is compared on, as its JSON states them (an infinite SQNR as null)."""
    latency = result.latency[0] if result.latency else None
    interval = latency.latency_ratio_interval if latency else None
    sqnr = result.overall.sqnr_db
    numbers = {
        "compression": result.compression_ratio,
        "sqnr": sqnr if math.isfinite(sqnr) else math.inf,
        "top1": min((a.top1 for a in result.classification), default=None),
        "top5": min((a.top5 for a in result.classification), default=None),
        "box_iou": min((b.mean_iou for b in result.boxes), default=None),
        "latency_ratio": latency.latency_ratio if latency else None,
        "latency_interval": tuple(interval) if interval else None,
        "provider": latency.provider if latency else None,
    }
    return Snapshot(numbers, result.reference.sha256, (result.data_dir, result.samples))


def _provider_accuracy(
    latency: Latency,
    reference: ort.InferenceSession,
    candidate_path: Path | str,
    dataset: Dataset,
    threads: int | None,
    options: EvaluationOptions,
) -> Latency:
    """``latency`` with the candidate's accuracy on its provider (a GPU's kernels are not the CPU's)."""
    if latency.provider == "CPUExecutionProvider":
        return latency
    providers = session_providers(latency.provider, options.trt_engine_cache)
    candidate = create_session(candidate_path, str(candidate_path), threads=threads, providers=providers)
    with stage(f"accuracy on {latency.provider}"):
        measured = output_metrics(reference, candidate, dataset, {}, task="none")
    worst = min((o.sqnr_db for o in measured.outputs), default=measured.overall.sqnr_db)
    return latency.model_copy(update={"candidate_sqnr_db": worst})


def _reproducibility(
    dataset: Dataset,
    config: QConfig | None,
    options: EvaluationOptions,
    latency: list[Latency],
) -> dict[str, Any]:
    """What the numbers depend on: config and data digests, versions, CPU, threads and providers."""
    threads = options.threads
    return {
        "config_sha256": config.source_sha256 if config is not None else None,
        "data": {"files": len(dataset.files), "sha256": files_digest(list(dataset.files))},
        "versions": versions(),
        "cpu": cpu_info(),
        "threads": {"intra_op": threads, "onnxruntime_default": threads is None},
        "providers_requested": requested_providers(options),
        "providers_measured": [lat.provider for lat in latency],
    }
