"""The measured placement choice: the accuracy settings resolved once, then candidates built, scored and timed."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import onnx

from qtool.calibration.decode_steps import with_decode_steps
from qtool.calibration.outputs import FloatOutputs
from qtool.choice.decode import decoder_to_score
from qtool.choice.selection import FloatModel, PlacementChoice, Samples, measure_placements
from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.evaluation.judged import judged_outputs
from qtool.evaluation.split import split_samples, spread_subset
from qtool.graph.session import create_session
from qtool.options import EvaluationOptions, SearchOptions
from qtool.pipeline.build import Builder
from qtool.pipeline.data import spread_dataset
from qtool.progress import ProgressFactory
from qtool.quantization.plan.records import QuantPlan
from qtool.schemas.config import MAX_LATENCY_RUNS, MAX_SEARCH_SECONDS
from qtool.schemes import AccuracyOptions

RANK_SAMPLES = 4  # samples of the sensitivity search's one per-layer pass (spread over the data)


def check_search(search: SearchOptions) -> None:
    """Refuse search settings that cannot mean anything (the config's are checked by its schema)."""
    if (search.max_float_nodes is not None and search.max_float_nodes < 1) or (
        search.samples is not None and search.samples < 1
    ):
        raise QtoolError("--max-float-nodes and the number of search samples must be >= 1")
    if search.search_seconds is not None and not 0 < search.search_seconds <= MAX_SEARCH_SECONDS:
        raise QtoolError(f"--search-seconds must be a number of seconds above 0 (at most {MAX_SEARCH_SECONDS})")
    if search.latency_runs is not None and not 0 <= search.latency_runs <= MAX_LATENCY_RUNS:
        raise QtoolError(f"--latency-runs must be an integer from 0 to {MAX_LATENCY_RUNS}")


def accuracy_settings(given: AccuracyOptions, search: SearchOptions) -> AccuracyOptions:
    """The config's ``accuracy:`` section with the options given on the command line (or in code) over it."""
    return AccuracyOptions(
        target_sqnr_db=given.target_sqnr_db if search.target_sqnr_db is None else search.target_sqnr_db,
        max_float_nodes=given.max_float_nodes if search.max_float_nodes is None else search.max_float_nodes,
        samples=given.samples if search.samples is None else search.samples,
        search_seconds=given.search_seconds if search.search_seconds is None else search.search_seconds,
        latency_runs=given.latency_runs if search.latency_runs is None else search.latency_runs,
        outputs=search.outputs or given.outputs,
        state=given.state,
    )


def choose(
    builder: Builder,
    data_dir: Path | str,
    search: SearchOptions,
    evaluation: EvaluationOptions,
    progress: ProgressFactory | None,
    known: FloatOutputs | None,
) -> tuple[QConfig, PlacementChoice | None]:
    """The config to write and what the choice measured (None: no target, the config's rules decide).

    The candidates stay in the builder, so the one kept is not rewritten again.
    """
    ws = builder.ws
    accuracy = accuracy_settings(ws.config.accuracy, search)
    if accuracy.target_sqnr_db is None:
        return ws.config, None
    config = replace(ws.config, accuracy=accuracy)

    def build(cfg: QConfig, keep: bool = True) -> tuple[QuantPlan, onnx.ModelProto]:
        built = builder.build(cfg, keep=keep)
        return built.plan, built.model

    # twice the samples, halved: one half chooses, the other validates the choice
    split = split_samples(spread_dataset(ws, data_dir, 2 * accuracy.samples, skip_nonfinite=evaluation.skip_nonfinite))
    # weights rounded against the data (storage-only's, by GPTQ) never see the samples their model is validated on
    builder.held_out = frozenset(path.resolve() for path in split.validation.files)
    source = "--outputs" if search.outputs else f"{ws.config.source}: accuracy.outputs"
    judged = judged_outputs(ws.prepared, accuracy.outputs, source, accuracy.state)
    float_model = FloatModel(ws.path, ws.prepared, ws.weights, builder.elements, judged.subset, judged.state)
    decoder = decoder_to_score(ws.prepared)
    with tempfile.TemporaryDirectory(prefix="qtool-decode-steps-") as scratch:
        selection, validation = split.selection, split.validation
        if decoder is not None:  # prefills and the decode step after each (see qtool.calibration.decode_steps)
            session = create_session(ws.prepared, "the float model", threads=evaluation.threads, weights=ws.weights)
            known = FloatOutputs()  # the prefills' float outputs, from the pass that writes the decode steps
            selection = with_decode_steps(selection, session, decoder, Path(scratch) / "selection", known)
            validation = with_decode_steps(validation, session, decoder, Path(scratch) / "validation", known)
        ranked = spread_subset(selection, min(RANK_SAMPLES, len(selection)))
        samples = Samples(selection, ranked, known, validation, split.selection_files, split.validation_files)
        config, choice = measure_placements(
            float_model, config, build, samples, threads=evaluation.threads, progress=progress
        )
    choice.judged_note = judged.note(choice.parts)
    return config, choice
