"""The kept placement scored on samples no candidate was scored on, and replaced when it misses there."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx

from qtool.choice.records import FloatModel, PlacementChoice, PlacementRound, Samples, meets
from qtool.choice.validated import Chooser, Validation, choose_then_validate
from qtool.evaluation.scoring import OutputScorer, signal_means
from qtool.progress import ProgressFactory
from qtool.quantization.plan.records import QuantPlan
from qtool.schemes import CandidateName


class Validator:
    """Scores placements on the validation samples, each once: the figure each promises.

    ``plans``: the candidates' plans and models by name (read when a placement is scored, so a candidate
    added later, the search's, is found).
    """

    def __init__(
        self,
        choice: PlacementChoice,
        plans: Mapping[CandidateName, tuple[QuantPlan, onnx.ModelProto]],
        samples: Samples,
        float_model: FloatModel,
        scoring: tuple[OutputScorer, ProgressFactory],
    ) -> None:
        scored, factory = scoring
        assert samples.validation is not None  # checked by the caller
        self.choice, self.plans, self.samples = choice, plans, samples
        self.scorer = float_model.scorer(
            samples.validation, samples.known, factory("validation samples", len(samples.validation))
        )
        self.signal = signal_means([scored, self.scorer])  # the float outputs' energy over every sample at hand
        self.rounds: list[PlacementRound] = []  # each placement scored, in order

    def __call__(self, name: CandidateName) -> Validation:
        """``name`` scored on the validation samples (once: a second call reads the first's figure)."""
        done = next((r.validation for r in self.rounds if r.choice == name), None)
        return done if done is not None else self.score_model(name, self.plans[name][1], f"the '{name}' placement")

    def score_model(self, name: CandidateName, model: onnx.ModelProto, what: str) -> Validation:
        """``model``, a version of placement ``name``, scored on the validation samples: a round of its own."""
        # a streaming model over sequences is scored as it runs, each model on its own state (see OutputScorer);
        # its bound is also taken over whole sequences, whose spread a new sequence will see
        confidence = self.choice.confidence
        score = self.scorer.score(model, what)
        bound = score.worst_bound_db(confidence, self.signal)
        sequences = self.scorer.per_sequence(score)
        if sequences:
            bound = min(bound, *(e.lower_bound_db(confidence) for e in sequences.values()))
        files = self.samples.validation_files if self.samples.validation_files is not None else self.scorer.files
        target = self.choice.target_sqnr_db
        found = Validation(list(files), score.worst_db, bound, meets(bound, target), closed_loop=sequences is not None)
        self.rounds.append(PlacementRound(name, found))
        return found

    def release(self) -> None:
        self.scorer.release()


class _WithoutMissed:
    """The placement choice's rule, made again without each candidate that missed on the validation samples."""

    def __init__(
        self, choice: PlacementChoice, redecide: Callable[[frozenset[CandidateName]], bool], missed: frozenset[str]
    ) -> None:
        self.choice, self.redecide = choice, redecide
        self.missed: list[CandidateName] = [c.name for c in choice.candidates if c.name in missed]

    def first(self) -> CandidateName | None:
        return self.choice.chosen

    def after(self, choice: CandidateName, validation: Validation) -> CandidateName | None:
        if validation.meets:
            return None
        self.missed.append(choice)
        return self.choice.chosen if self.redecide(frozenset(self.missed)) else None


def validate_choice(
    choice: PlacementChoice,
    validator: Validator,
    redecide: Callable[[frozenset[CandidateName]], bool],
) -> None:
    """Score the kept placement on the validation samples; when its bound misses the target, decide again.

    ``redecide(missed)`` makes the choice again, by the same rule, without the candidates that
    missed on the validation samples: the next fastest that reached the target on the scored
    samples is validated next, not the most accurate one. When every candidate that reached the
    target misses it here, the one with the best validation bound is kept. A placement ``validator``
    scored before (the search's, before it was timed) counts with its figure, in its place.
    """
    target = choice.target_sqnr_db
    earlier = frozenset(r.choice for r in validator.rounds if not r.validation.meets)
    chooser: Chooser[CandidateName] = _WithoutMissed(choice, redecide, earlier)
    choose_then_validate(chooser, validator)
    rounds = choice.validations = list(validator.rounds)  # every placement it scored, the search's first too
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
    elif missed and choice.chosen_candidate.meets_target:  # the only one that reached it (the last one validated)
        validation = missed[-1].validation
        choice.reason = (
            f"{choice.reason} on the scored samples, but not on {len(validation.samples)} other samples "
            f"({validation.bound_db:.2f} dB, {choice.confidence:.0%} bound): none is validated at {target:g} dB"
        )
