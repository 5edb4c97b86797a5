"""The kept placement scored on samples no candidate was scored on, and replaced when it misses there."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx
import onnxruntime as ort

from qtool.choice.records import CandidateName, FloatModel, PlacementChoice, PlacementValidation, Samples, meets
from qtool.evaluation.closed_loop import ClosedLoopScore, closed_loop_score
from qtool.evaluation.scoring import OutputScorer, signal_means
from qtool.graph.session import create_session
from qtool.progress import ProgressFactory


def validate_choice(
    choice: PlacementChoice,
    models: Mapping[CandidateName, onnx.ModelProto],
    samples: Samples,
    float_model: FloatModel,
    factory: ProgressFactory,
    scored: OutputScorer,
    redecide: Callable[[frozenset[CandidateName]], bool],
) -> None:
    """Score the kept placement on the validation samples; when its bound misses the target, decide again.

    ``redecide(missed)`` makes the choice again, by the same rule, without the candidates that
    missed on the validation samples: the next fastest that reached the target on the scored
    samples is validated next, not the most accurate one. When every candidate that reached the
    target misses it here, the one with the best validation bound is kept.
    """
    assert samples.validation is not None  # checked by the caller
    scorer = float_model.scorer(
        samples.validation, samples.known, factory("validation samples", len(samples.validation))
    )
    target = choice.target_sqnr_db
    signal = signal_means([scored, scorer])  # the float outputs' energy over every sample at hand
    float_session: list[ort.InferenceSession] = []  # created on the first closed-loop check, kept for the next

    def check(name: CandidateName) -> PlacementValidation:
        score = scorer.score(models[name], f"the '{name}' placement")
        worst, bound = score.worst_db, score.worst_bound_db(choice.confidence, signal)
        loop = _closed_loop(float_model, models[name], samples, float_session) if meets(bound, target) else None
        if loop is not None:  # a streaming model over sequences: as it runs, on its own state
            worst, bound = min(worst, loop.worst_db), min(bound, *loop.bounds.values())
        files = samples.validation_files if samples.validation_files is not None else scorer.files
        found = PlacementValidation(name, list(files), worst, bound, meets(bound, target), loop is not None)
        choice.validations.append(found)
        return found

    first = check(choice.chosen)
    missed: list[PlacementValidation] = []
    found = first
    while not found.meets_target:
        missed.append(found)
        if not redecide(frozenset(v.candidate for v in missed)):
            break
        found = check(choice.chosen)
    if found.meets_target and missed:
        names = ", ".join(f"'{v.candidate}' ({v.bound_db:.2f} dB)" for v in missed)
        choice.reason = (
            f"{choice.reason}; validated on {len(first.samples)} other samples, where {names} missed "
            f"{target:g} dB ({choice.confidence:.0%} bound)"
        )
    elif not found.meets_target and len(missed) > 1:
        best = max(missed, key=lambda v: (v.bound_db, -missed.index(v)))
        choice.chosen = best.candidate
        choice.reason = (
            f"no placement reaches {target:g} dB on the validation samples ({choice.confidence:.0%} bound): "
            f"'{best.candidate}' comes closest ({best.bound_db:.2f} dB)"
        )
    scorer.release()


def _closed_loop(
    float_model: FloatModel, model: onnx.ModelProto, samples: Samples, float_session: list[ort.InferenceSession]
) -> ClosedLoopScore | None:
    """The candidate and the float model each run closed-loop over the validation sequences (None: none there).

    ``float_session``: the float model's session once created (empty before), shared by every candidate's check.
    """
    assert samples.validation is not None  # validated only with validation samples
    if not float_model.state or not float_model.judged:
        return None
    if not float_session:
        float_session.append(create_session(float_model.prepared, "the float model", weights=float_model.weights))
    sessions = (float_session[0], create_session(model, "the candidate", weights=float_model.weights))
    return closed_loop_score(sessions, samples.validation, float_model.state, sorted(float_model.judged))
