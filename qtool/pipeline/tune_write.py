"""tune's last step: the chosen config written, its model built as quantize --config builds it, both scored."""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import onnx

from qtool._version import __version__
from qtool.calibration.decode_steps import has_decode_steps
from qtool.calibration.feeds import sample_directory
from qtool.choice.tune.candidates import Candidates
from qtool.choice.tune.configs import allocation_document, config_text
from qtool.choice.tune.loop import marked
from qtool.choice.tune.selection import Outcome
from qtool.choice.tune.sensitivity import Sensitivity, nsr
from qtool.choice.validated import Validation
from qtool.config import load_config
from qtool.graph.model_io import write_text
from qtool.options import DEFAULT_OUTPUT, DEFAULT_SEARCH
from qtool.pipeline.quantize import QuantizeRequest, quantize
from qtool.pipeline.tune_state import TuneRequest, Tuning
from qtool.pipeline.workspace import open_workspace
from qtool.progress import ProgressFactory
from qtool.results import ModelFile, TuneResult
from qtool.system.stages import stage


def write_chosen(
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
        written = candidates.verify(model, chosen.allocation, nsr(chosen.predicted_sqnr_db))
        validation = candidates.validate(model)
    met = validation.meets and outcome.reachable and chosen.meets
    if written.note.startswith("slower"):
        met = False
    notes = _notes(outcome, validation, sens)
    trials, chosen = marked(outcome.trials, chosen)
    return TuneResult(
        source=tuning.ws.source,
        output=ModelFile.of(request.output_path),
        config_out=str(request.config_out),
        objective=request.options.objective,
        goal=tuning.goal.describe(),
        target_sqnr_db=tuning.goal.target_sqnr_db,
        trials=trials,
        chosen=chosen,
        written=replace(written, chosen=True),  # the chosen trial, as written
        validation=validation,
        rounds=outcome.rounds,
        margin=outcome.margin,
        confidence=tuning.goal.confidence,
        validation_confidence=candidates.validation_confidence,
        selection_samples=tuning.split.selection_files,  # EVAL's own files, each named once
        met=met,
        reachable=outcome.reachable,
        out_of_time=outcome.out_of_time,
        stalled=outcome.stalled,
        sensitivity=sens,
        seconds=time.monotonic() - tuning.started,
        time_budget=request.options.time_budget,
        notes=notes,
        decode_steps_scored=has_decode_steps(candidates.validation.files),
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
