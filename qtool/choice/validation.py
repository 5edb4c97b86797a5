"""The kept placement scored on samples no candidate was scored on, and replaced when it misses there."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx

from qtool.choice.records import CandidateName, FloatModel, PlacementChoice, Samples, meets
from qtool.choice.validated import Chooser, Validation, choose_then_validate
from qtool.evaluation.scoring import OutputScorer, signal_means
from qtool.progress import ProgressFactory


class _WithoutMissed:
    """The placement choice's rule, made again without each candidate that missed on the validation samples."""

    def __init__(self, choice: PlacementChoice, redecide: Callable[[frozenset[CandidateName]], bool]) -> None:
        self.choice, self.redecide = choice, redecide
        self.missed: list[CandidateName] = []

    def first(self) -> CandidateName | None:
        return self.choice.chosen

    def after(self, choice: CandidateName, validation: Validation) -> CandidateName | None:
        if validation.meets:
            return None
        self.missed.append(choice)
        return self.choice.chosen if self.redecide(frozenset(self.missed)) else None


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

    def check(name: CandidateName) -> Validation:
        # a streaming model over sequences is scored as it runs, each model on its own state (see OutputScorer);
        # its bound is also taken over whole sequences, whose spread a new sequence will see
        score = scorer.score(models[name], f"the '{name}' placement")
        bound = score.worst_bound_db(choice.confidence, signal)
        sequences = scorer.per_sequence(score)
        if sequences:
            bound = min(bound, *(e.lower_bound_db(choice.confidence) for e in sequences.values()))
        files = samples.validation_files if samples.validation_files is not None else scorer.files
        return Validation(list(files), score.worst_db, bound, meets(bound, target), closed_loop=sequences is not None)

    chooser: Chooser[CandidateName] = _WithoutMissed(choice, redecide)
    rounds = choose_then_validate(chooser, check)
    choice.validations = rounds
    missed = [r for r in rounds if not r.validation.meets]
    if rounds and rounds[-1].validation.meets and missed:
        names = ", ".join(f"'{r.choice}' ({r.validation.bound_db:.2f} dB)" for r in missed)
        choice.reason = (
            f"{choice.reason}; validated on {len(rounds[0].validation.samples)} other samples, where {names} missed "
            f"{target:g} dB ({choice.confidence:.0%} bound)"
        )
    elif len(missed) > 1 and not rounds[-1].validation.meets:
        best = max(missed, key=lambda r: (r.validation.bound_db, -missed.index(r)))
        choice.chosen = best.choice
        choice.reason = (
            f"no placement reaches {target:g} dB on the validation samples ({choice.confidence:.0%} bound): "
            f"'{best.choice}' comes closest ({best.validation.bound_db:.2f} dB)"
        )
    scorer.release()
