"""The ``quantize`` pipeline: passes -> statistics -> placement choice -> build -> write -> compare."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from onnx import numpy_helper

from qtool._version import __version__
from qtool.calibration.kv_cache_ranges import CacheRanges
from qtool.calibration.outputs import FloatOutputs
from qtool.calibration.statistics import CalibrationStats
from qtool.calibration.taps import BatchTap
from qtool.choice.selection import PlacementChoice
from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.evaluation.compare import compare
from qtool.evaluation.latency import latency_record
from qtool.evaluation.opened import OpenedModel
from qtool.evaluation.pairing import FLOAT_TYPES
from qtool.graph.checks import check_quantized_model
from qtool.graph.float16 import refuse_bfloat16, store_float16
from qtool.graph.index import GraphView, all_nodes
from qtool.graph.input_shapes import restore_input_dims
from qtool.graph.model_files import same_file
from qtool.graph.model_io import save_model
from qtool.graph.ort_rewrites import fp8_relu_note
from qtool.graph.session import create_session
from qtool.options import QUANTIZE_EVALUATION, CalibrationOptions, EvaluationOptions, OutputOptions, SearchOptions
from qtool.pipeline.build import Builder, Built, data_inputs, input_collector, weight_algorithms
from qtool.pipeline.calibrate import observe, read_statistics, without_data
from qtool.pipeline.choose import choose
from qtool.pipeline.data import tapped_pass
from qtool.pipeline.kv_cache import apply_kv_cache, cache_ranges_tap, check_kv_cache
from qtool.pipeline.passes import BEFORE_QUANTIZATION, PassInputs, run_passes, with_statistics
from qtool.pipeline.peer import check_peer_data, measured_beside_onnxruntime
from qtool.pipeline.workspace import Workspace
from qtool.progress import ProgressFactory
from qtool.quantization.algorithms.rounding.node_inputs import NodeInputCollector
from qtool.quantization.plan.branches import every_kernel
from qtool.quantization.plan.kernels import float_boundaries
from qtool.quantization.plan.records import QuantPlan
from qtool.results import ComparisonResult, ModelFile, QuantizeResult
from qtool.schemes import CPU_TARGETS
from qtool.system.stages import stage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizeRequest:
    """What one ``quantize`` run reads besides the workspace."""

    output_path: Path
    stats_path: Path | str | None
    data_dir: Path | str | None
    calibration: CalibrationOptions
    search: SearchOptions | None
    evaluation: EvaluationOptions | None
    eval_dir: Path | str | None
    output: OutputOptions
    config_source: Path | str | Mapping[str, Any] | None = None  # as given: the comparison reads it again
    input_shapes: Mapping[str, Sequence[int]] | None = None
    vs_onnxruntime: bool = False  # also measure onnxruntime's quantize_static model of the same file beside

    @property
    def search_dir(self) -> Path | str | None:
        """The samples the placement choice and the weight algorithms read (None: no search)."""
        return (self.search.data_dir or self.data_dir) if self.search is not None else None


@dataclass(frozen=True)
class Statistics:
    """The statistics a run quantizes with, and what their float pass kept for later stages."""

    stats: CalibrationStats
    known: FloatOutputs | None  # float outputs of the calibration samples (placement choice, comparison)
    collector: NodeInputCollector | None  # the weight algorithms' inputs, when a node asks for them
    calibrated: bool  # the collector (and the cache ranges) were fed by the calibration pass
    cache: CacheRanges | None = None  # a decoder's key/value cache ranges, when kv_cache: is set


def check_sources(stats_path: Path | str | None, data_dir: Path | str | None, vs_onnxruntime: bool) -> None:
    """Refuse before any work statistics given twice, and ``--vs-onnxruntime`` without local samples."""
    if stats_path is not None and data_dir is not None:
        raise QtoolError("give either --stats STATS.json or --data DATA_DIR, not both")
    if vs_onnxruntime:
        check_peer_data(data_dir)


def check_outputs(model_path: Path, output_path: Path) -> None:
    """Refuse an output path before any work: it must be a new ``.onnx`` file, never the input."""
    if output_path.suffix.lower() != ".onnx":
        raise QtoolError(f"output path {output_path} must end in .onnx")
    if same_file(model_path, output_path):
        raise QtoolError(
            f"output {output_path} is the input model; qtool never overwrites its input", hint="choose another -o path"
        )


def statistics(ws: Workspace, request: QuantizeRequest, progress: ProgressFactory | None) -> Statistics:
    """Run the passes and get the statistics: from ``--stats``, by calibrating on ``--data``, or none needed."""
    calibration = request.calibration
    if request.stats_path is not None:
        # a module:Class observer in the file is imported only if the user named it too
        trusted = ws.config.observer_references() | ({calibration.observer} if calibration.observer else set())
        stats = read_statistics(ws, request.stats_path, frozenset(trusted))
        search_data = request.search.data_dir if request.search is not None else None
        run_passes(
            ws, with_statistics(stats, request.stats_path), PassInputs(search_data, calibration, stats.smoothing)
        )
        collector, cache = input_collector(ws), cache_ranges_tap(ws)
        taps: list[BatchTap] = [tap for tap in (collector, cache) if tap is not None]
        if taps and search_data is not None:  # what the file's statistics cannot hold, in one pass of the samples
            tapped_pass(ws, search_data, calibration, taps, "what the weight algorithms and the key/value cache read")
        return Statistics(stats, None, collector, calibrated=bool(taps) and search_data is not None, cache=cache)
    if request.data_dir is None:
        return Statistics(without_data(ws), None, None, calibrated=False)
    run_passes(ws, BEFORE_QUANTIZATION, PassInputs(request.data_dir, calibration))
    collector, cache = input_collector(ws), cache_ranges_tap(ws)
    known = FloatOutputs()  # computed anyway: they serve the placement choice and the comparison
    stats = observe(ws, request.data_dir, calibration, progress, known, collector, cache)
    return Statistics(stats, known, collector, calibrated=True, cache=cache)


def quantize(ws: Workspace, request: QuantizeRequest, progress: ProgressFactory | None) -> QuantizeResult:
    """Quantize the workspace's model and write it; compare it with the float model when asked."""
    refuse_bfloat16(ws.model, str(ws.path))  # (inspect shows the nodes it would keep float)
    check_kv_cache(ws, request.data_dir or request.search_dir)
    data = statistics(ws, request, progress)
    search_dir = request.search_dir
    algorithms, note = weight_algorithms(ws, data.collector, data.calibrated)
    inputs = data_inputs(ws, search_dir, request.calibration) if search_dir is not None else None
    builder = Builder(ws, data.stats, algorithms, inputs)
    config, choice, unjudged = ws.config, None, None
    if ws.config.target not in CPU_TARGETS and request.search is not None and search_dir is not None:
        log.info("target %s: placement by its rules (CPU timing says nothing about it)", ws.config.target)
    elif request.search is not None and search_dir is not None and not _float_outputs(ws):
        unjudged = "no placement choice: the model has no float output to judge accuracy by (its rules place the nodes)"
    elif request.search is not None and search_dir is not None:
        with stage("placement choice (accuracy, search, latency)"):
            evaluation = request.evaluation or QUANTIZE_EVALUATION
            config, choice = choose(builder, search_dir, request.search, evaluation, progress, data.known)
    unmeasured = _unmeasured_placement(builder, config, request, search_dir)
    if unmeasured is not None:
        config = unmeasured[0]
    with stage("insert Q/DQ"):
        built = builder.build(config)
        builder.forget()
    ws.transforms.credit(built.report.algorithms, built.report.algorithm_notes)
    cache_note = apply_kv_cache(ws, built.model, data.cache)
    result = _write(ws, built, request.output_path, request.output, data.stats, choice)
    result.notes += [n for n in (note, cache_note, unjudged) if n]
    result.notes += [unmeasured[1]] if unmeasured is not None else []
    result.notes += preparation_notes(ws)
    if request.evaluation is not None and (request.eval_dir is not None or request.data_dir is not None):
        result.comparison = compared(result, ws, (built, request), progress, data.known)
    if request.vs_onnxruntime and request.data_dir is not None:
        data_dirs, options = (request.data_dir, request.eval_dir), (request.calibration, request.evaluation)
        result.peer = measured_beside_onnxruntime(ws, request.output_path, data_dirs, *options)
    return result


def _unmeasured_placement(
    builder: Builder, config: QConfig, request: QuantizeRequest, search_dir: Path | str | None
) -> tuple[QConfig, str] | None:
    """Without samples to measure the placement on a CPU, no integer kernel is guessed in: it may run slower.

    The rules' guess puts large convolutions on integer kernels; whether they pay off depends on the
    CPU (uint8-stored weights halve them on VNNI CPUs). With no samples to measure that, nodes the
    rules place ``auto`` are kept storage-only (fp32 speed, the same stored bytes), and the note says
    so and what would decide. With ``--no-search`` the rules' guess is kept, and the note says it is
    unmeasured. None: nothing to say (measured, explicit placements only, or another target).
    """
    if config.target not in CPU_TARGETS or search_dir is not None:
        return None
    guessed = [
        n for n in builder.plan(config).every_node() if n.placement == "integer" and n.scheme.placement == "auto"
    ]
    if not guessed:
        return None
    if request.search is None:
        return config, (
            f"placement by the rules' guess, not measured (--no-search): {len(guessed)} nodes run integer kernels, "
            "which can be slower than fp32 on this CPU; give --search-data DIR to measure"
        )
    target = config.accuracy.target_sqnr_db
    unchecked = f"; the accuracy target ({target:g} dB) is not checked either" if target is not None else ""
    return replace(config, auto_placement="storage"), (
        f"no samples to measure the placement: the {len(guessed)} nodes the rules would put on integer kernels "
        f"are stored quantized and compute in float (fp32 speed){unchecked}; give --search-data DIR (or --data) "
        "to measure whether integer kernels pay off here"
    )


def _write(
    ws: Workspace,
    built: Built,
    output_path: Path,
    output: OutputOptions,
    stats: CalibrationStats,
    choice: PlacementChoice | None,
) -> QuantizeResult:
    """Check the quantized model, load it in onnxruntime, write it atomically and describe it."""
    quantized, plan = built.model, built.plan
    if ws.report.float16_weights:  # first, so that retain frees the float32 copies of the weights kept float
        store_float16(quantized, set(ws.report.float16_weights), ws.weights)
    ws.weights.retain(quantized)  # the float weights the output replaced: freed before it is checked and written
    quantized.producer_name = "qtool"
    quantized.producer_version = __version__
    restore_input_dims(quantized, ws.original_inputs)
    check_note = check_quantized_model(quantized, ws.prepared)
    with stage("load the result in onnxruntime"):
        # onnxruntime loads it: write it (the session is let go first, its copy of the weights with it)
        _loads(quantized, ws)
    with stage(f"write {output_path}"):
        written = save_model(quantized, output_path, ws.weights, external=output.external_data)
    result = QuantizeResult(
        source=ws.source,
        output=ModelFile.of(output_path),
        prepare=ws.report,
        rewrite=built.report,
        skipped=list(plan.skipped),
        placements=dict(sorted(_placements(plan).items())),
        kernels=dict(sorted(Counter(k.kernel for k in every_kernel(ws.prepared, plan).values()).items())),
        boundaries=float_boundaries(ws.graph, plan) if plan.target in CPU_TARGETS else {},
        calibration_samples=stats.samples,
        search=choice.search if choice else None,
        placement_choice=choice,
        data_files=[str(p) for p in written[1:]],
    )
    result.notes += [check_note] if check_note else []
    relu_note = fp8_relu_note(quantized)
    result.notes += [relu_note] if relu_note else []
    result.notes += _static_instead_of_dynamic(plan)
    return result


def _static_instead_of_dynamic(plan: QuantPlan) -> list[str]:
    """Say which nodes a ``mode: dynamic`` rule asked for but run statically quantized (calibrated), and why."""
    static = Counter(
        node.op_type for node in plan.every_node() if node.scheme.mode == "dynamic" and node.placement == "integer"
    )
    if not static:
        return []
    counted = ", ".join(f"{count} {op}" for op, count in sorted(static.items()))
    return [
        f"mode: dynamic applies to MatMul and Gemm with a constant int8 weight: {counted} quantized statically "
        "instead (their activation ranges come from the calibration data)"
    ]


def preparation_notes(ws: Workspace) -> list[str]:
    """What preparing the model changed that the user should know."""
    notes = []
    if ws.report.initializers_removed_from_inputs:
        notes.append(
            f"{ws.report.initializers_removed_from_inputs} initializers were listed as graph inputs; "
            "they are treated as constants and no longer inputs"
        )
    if ws.report.sorted_nodes:
        notes.append("the model's nodes were out of order (onnx requires each after what it reads): they were sorted")
    if ws.report.shape_inference_error:
        notes.append(f"shape inference failed and was skipped: {ws.report.shape_inference_error}")
    if ws.report.float16_weights is not None:
        notes.append(
            "the model computes in float16: it is quantized from its float32 form and the written model computes "
            "in float32 behind the same float16 inputs and outputs; the weights it keeps in float stay float16"
        )
    return notes + _training_form(ws.model)


def _training_form(model: onnx.ModelProto) -> list[str]:
    """A note when the model was exported in training form (BatchNorm on each batch's statistics, live Dropout)."""
    view = GraphView(model)
    constants = dict(view.every_initializer)
    for node in view.nodes:  # Constant nodes too: the model as read
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    norms = [
        n
        for n in all_nodes(model.graph)
        if n.op_type == "BatchNormalization"
        and (len([o for o in n.output if o]) > 1 or any(a.name == "training_mode" and a.i for a in n.attribute))
    ]
    live = [n.input[2] for n in all_nodes(model.graph) if n.op_type == "Dropout" and len(n.input) > 2]
    drops = [name for name in live if name in constants and numpy_helper.to_array(constants[name]).all()]
    if not norms and not drops:
        return []
    parts = [f"{len(norms)} BatchNormalization normalize each batch by its own statistics"] if norms else []
    parts += [f"{len(drops)} Dropout drop values at random"] if drops else []
    said = " and ".join(parts)
    return [f"the model was exported in training form: {said}; export it with model.eval() to quantize what it runs"]


def _loads(quantized: onnx.ModelProto, ws: Workspace) -> None:
    """Load the result in onnxruntime; when it cannot, whether it loads the input says whose failure it is.

    The input refused too (an op this onnxruntime lacks, a locale the machine lacks): the input's error, exit 2,
    naming the file. Only the result refused: a bug in qtool's rewrite.
    """
    try:
        create_session(quantized, "the quantized model", weights=ws.weights)
    except QtoolError as e:
        create_session(ws.path, str(ws.path))  # raises the input's own error when it fails the same way
        raise RuntimeError(f"onnxruntime loads {ws.path} but not the model qtool made of it: {e}") from e


def compared(
    result: QuantizeResult,
    ws: Workspace,
    written: tuple[Built, QuantizeRequest],
    progress: ProgressFactory | None,
    known: FloatOutputs | None,
) -> ComparisonResult:
    """The written model compared with the float one, both as held in memory; a timed choice's latency is reused.

    ``written``: the model as written (its graph, whose weights ``ws`` holds) and the request that wrote it.
    """
    built, request = written
    assert request.evaluation is not None  # the caller compares only when asked
    evaluation, choice = request.evaluation, result.placement_choice
    timed = choice is not None and choice.chosen in choice.times and evaluation.runs > 0
    if request.eval_dir is None:
        log.warning(
            "the comparison scores the model on the samples it was calibrated on (%s): not held out, "
            "so optimistic; give --eval DIR for held-out samples",
            request.data_dir,
        )
    scored = request.eval_dir if request.eval_dir is not None else request.data_dir
    assert scored is not None  # the caller compares only with samples
    named = request.search.outputs if request.search is not None else ()
    accuracy = ws.config.accuracy  # what the target judged, and the state it carried
    evaluation = replace(evaluation, outputs=named or accuracy.outputs, state=accuracy.state)
    # the input as read (its session made from the file), the output as written (its session from memory)
    source = OpenedModel(ws.path, ws.source, ws.model, detached=True)

    def output_session(threads: int | None) -> ort.InferenceSession:
        return create_session(built.model, "the quantized model", threads=threads, weights=ws.weights)

    output = OpenedModel(request.output_path, result.output, built.model, output_session, detached=True)
    comparison = compare(
        source,
        output,
        scored,
        options=replace(evaluation, runs=0) if timed else evaluation,
        config_path=ws.config,
        progress=progress,
        known=known if request.eval_dir is None else None,
        input_shapes=request.input_shapes,
    )
    comparison = replace(comparison, calibration_data=request.eval_dir is None)
    return _with_choice_latency(comparison, choice) if timed and choice is not None else comparison


def _with_choice_latency(comparison: ComparisonResult, choice: PlacementChoice) -> ComparisonResult:
    """``comparison`` with the latency the placement choice measured of the kept model against fp32."""
    # The choice already timed this very model against fp32, interleaved: that is the latency to report (over the
    # rounds both ran in: fp32 goes on with the candidates whose comparison took more rounds)
    rounds = min(len(choice.times["fp32"]), len(choice.times[choice.chosen]))
    times = (choice.times["fp32"][:rounds], choice.times[choice.chosen][:rounds])
    latency = latency_record("CPUExecutionProvider", choice.threads, times)
    reproducibility = {
        **comparison.reproducibility,
        "threads": {"intra_op": choice.threads, "onnxruntime_default": False},
        "providers_measured": [latency.provider],
    }
    return replace(comparison, latency=[latency], reproducibility=reproducibility)


def _placements(plan: QuantPlan) -> Counter[str]:
    """How many nodes run each way; a recurrent node whose weights are stored counts as storage."""
    return Counter(n.kind for n in plan.every_node()) + Counter({"storage": len(plan.recurrent_nodes())})


def _float_outputs(ws: Workspace) -> list[str]:
    """The model's outputs that hold floating-point values (what accuracy can be measured on)."""
    return [o.name for o in ws.prepared.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
