"""The kept placement scored on samples no candidate was scored on, and replaced when it misses there."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx

from qtool.choice.records import CandidateName, FloatModel, PlacementChoice, PlacementValidation, Samples, meets
from qtool.evaluation.scoring import OutputScorer, signal_means
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

    def check(name: CandidateName) -> PlacementValidation:
        # a streaming model over sequences is scored as it runs, each model on its own state (see OutputScorer);
        # its bound is also taken over whole sequences, whose spread a new sequence will see
        score = scorer.score(models[name], f"the '{name}' placement")
        bound = score.worst_bound_db(choice.confidence, signal)
        sequences = scorer.per_sequence(score)
        if sequences:
            bound = min(bound, *(e.lower_bound_db(choice.confidence) for e in sequences.values()))
        files = samples.validation_files if samples.validation_files is not None else scorer.files
        found = PlacementValidation(
            name, list(files), score.worst_db, bound, meets(bound, target), sequences is not None
        )
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
