"""The kept placement scored on samples no candidate was scored on, and replaced when it misses there."""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from qtool.evaluation.scoring import OutputScorer, signal_means
from qtool.progress import ProgressFactory
from qtool.quantization.placement_types import FloatModel, PlacementChoice, PlacementValidation, Samples, meets


def validate_choice(
    choice: PlacementChoice,
    models: Mapping[str, onnx.ModelProto],
    samples: Samples,
    float_model: FloatModel,
    factory: ProgressFactory,
    scored: OutputScorer,
) -> None:
    """Score the kept placement on the validation samples; when its bound misses the target, try the most accurate.

    The most accurate placement that reached the target on the scored samples replaces the kept one
    only when it reaches the target on the validation samples too (robust before fast).
    """
    assert samples.validation is not None  # checked by the caller
    scorer = OutputScorer(
        float_model.prepared,
        samples.validation,
        weights=float_model.weights,
        on_sample=factory("validation samples", len(samples.validation)),
        known=samples.known,
    )
    target = choice.target_sqnr_db
    signal = signal_means([scored, scorer])  # the float outputs' energy over every sample at hand

    def check(name: str) -> PlacementValidation:
        score = scorer.score(models[name], f"the '{name}' placement")
        bound = score.worst_bound_db(choice.confidence, signal)
        files = samples.validation_files if samples.validation_files is not None else scorer.files
        found = PlacementValidation(name, list(files), score.worst_db, bound, meets(bound, target))
        choice.validations.append(found)
        return found

    kept = check(choice.chosen)
    safer = [c for c in choice.candidates if c.meets_target and c.sqnr_db > choice.chosen_candidate.sqnr_db]
    if not kept.meets_target and safer:
        most_accurate = max(safer, key=lambda c: (c.sqnr_db, -choice.candidates.index(c)))
        if check(most_accurate.name).meets_target:
            choice.chosen = most_accurate.name
            choice.reason = (
                f"the most accurate placement that reaches {target:g} dB: the faster '{kept.candidate}' reached it on "
                f"the scored samples but not on {len(kept.samples)} others ({kept.bound_db:.2f} dB, "
                f"{choice.confidence:.0%} bound)"
            )
    scorer.release()
