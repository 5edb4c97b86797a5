"""Placements with GPTQ-rounded weights: storage-only when even it misses the target, and the kept integer one.

Storage-only computes in float on weights stored at 8 bits, so what it loses is the weights' rounding
alone, and rounding to nearest ignores what each weight is multiplied by. GPTQ rounds each weight
against its node's calibration inputs, so that the node's outputs move least, and each bias then takes
away the mean output shift that its weight's rounding still causes, ``-(W~ - W) E[x_patch]`` (exact for a
node with float inputs, from the mean patches of the same pass: no model run). The same graph with other
codes and biases, so at no cost in speed or size (the default's worst output on the evaluation files, to
nearest -> GPTQ -> GPTQ with the biases corrected, fitted on 32 samples none of which validates: PP-OCR
recogniser 17.8 -> 26.8 -> 28.0 dB; PP-OCR detector 12.2 -> 14.1 -> 25.1 dB; a generated audio front end
32.1 -> 47.1 -> 52.2 dB). It costs a float pass over 32 samples spread over those the choice does not
validate on (what is validated never fitted the weights), which sums a lighter Hessian and the mean patch per
node (:data:`~qtool.quantization.algorithms.rounding.node_inputs.LIGHT_PATCHES`), and the rounding itself, so it
is tried only where storage-only misses the target: on the scored samples (where the search would
otherwise keep whole nodes float), or on the validation samples when no placement is validated there.
It is kept only where it scores higher, and after a validation miss only where it validates higher.

The placement kept with integer kernels gets the same rounding once the choice is made (:func:`round_kept_integer`):
the placements are compared rounded to nearest, and the one kept is then rounded by GPTQ, its biases as rounded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import onnx

from qtool.choice.candidates import BuiltCandidates
from qtool.choice.move_costs import storage_candidate
from qtool.choice.records import CandidateBuilder, PlacementChoice, meets
from qtool.choice.validation import Validator
from qtool.evaluation.scoring import OutputScorer
from qtool.quantization.plan.records import QuantPlan
from qtool.schemes import CandidateName
from qtool.system.stages import stage

CORRECTED_INTEGER = False  # the kept integer placement's biases: corrected (measured on the quantized model) or not


@dataclass(frozen=True)
class Rounded:
    """A placement rebuilt with GPTQ-rounded weights, scored; not yet in the candidates."""

    name: CandidateName  # the candidate it would replace
    plan: QuantPlan
    model: onnx.ModelProto
    nearest_db: float  # the candidate rounded to nearest, on the scored samples
    score_db: float  # rounded by GPTQ, on the same samples
    corrected: bool  # its biases corrected for the rounding too


def round_storage(
    choice: PlacementChoice, built: BuiltCandidates, build: CandidateBuilder, scorer: OutputScorer
) -> None:
    """The storage-only candidate rounded by GPTQ, when it misses the target and the rounded weights score higher."""
    name = storage_candidate(built)
    if name is None or meets(built.scores[name], choice.target_sqnr_db):
        return
    rounded = _rounded(choice, built, build, scorer, name)
    if rounded is not None:
        _adopt(choice, built, rounded)
        choice.rounding_note = (
            f"storage-only misses {choice.target_sqnr_db:g} dB rounded to nearest ({rounded.nearest_db:.2f} dB): its "
            f"weights are rounded by GPTQ, their biases corrected ({rounded.score_db:.2f} dB)"
        )


def round_after_miss(
    choice: PlacementChoice,
    built: BuiltCandidates,
    build: CandidateBuilder,
    scorer: OutputScorer,
    validator: Validator,
) -> None:
    """When no placement is validated at the target and storage-only missed there, its weights rounded by GPTQ.

    Kept when its validation bound is above every placement's that was validated: chosen when it reaches
    the target there, or as the one that comes closest.
    """
    rounds, name = choice.validations, storage_candidate(built)
    missed = next((r.validation for r in rounds if r.choice == name), None)
    if name is None or missed is None or rounds[-1].validation.meets:
        return
    rounded = _rounded(choice, built, build, scorer, name)
    if rounded is None:
        return
    found = validator.score_model(name, rounded.model, "storage-only with GPTQ-rounded weights")
    best = max(r.validation.bound_db for r in rounds)
    if not found.bound_db > best:
        choice.rounding_note = (
            f"storage-only's weights rounded by GPTQ (biases corrected) validated at {found.bound_db:.2f} dB, no "
            f"closer to {choice.target_sqnr_db:g} dB than {best:.2f} dB: kept to nearest"
        )
        return
    _adopt(choice, built, rounded)
    choice.validations, choice.chosen = list(validator.rounds), name
    bound = f"{choice.confidence:.0%} bound"
    choice.rounding_note = (
        f"storage-only misses {choice.target_sqnr_db:g} dB on the validation samples rounded to nearest "
        f"({missed.bound_db:.2f} dB, {bound}): its weights are rounded by GPTQ, their biases corrected "
        f"({found.bound_db:.2f} dB there)"
    )
    choice.reason = (
        f"storage-only with GPTQ-rounded weights {'reaches' if found.meets else 'comes closest to'} "
        f"{choice.target_sqnr_db:g} dB on the validation samples ({found.bound_db:.2f} dB, {bound}), where no "
        "placement rounded to nearest did"
    )


def round_kept_integer(
    choice: PlacementChoice,
    built: BuiltCandidates,
    build: CandidateBuilder,
    scorer: OutputScorer,
    validator: Validator | None,
) -> None:
    """The kept placement's weights rounded by GPTQ when it runs integer kernels: the same graph, fewer errors.

    An integer kernel's output carries its weights' rounding into every node after it, and the placement
    choice rounds to nearest to compare placements cheaply. Once one with integer nodes is kept, its weights
    are rounded by GPTQ (fitted on samples none of which validates): kept where it scores higher, and where it
    validates no lower than rounded to nearest did (MobileNetV2-style, the sample CNN: 6-7 dB more on the
    evaluation files, at the speed the choice measured). Its biases are left as rounded: measuring their shift
    on the quantized model would double the rounding's cost for a few tenths of a decibel.
    """
    name = choice.chosen
    if not choice.chosen_candidate.integer_nodes or built.configs[name].auto_rounding:
        return
    nodes = built.plans[name][0].every_node()
    if not any(
        n.weight is not None and n.placement == "integer" and n.scheme.algorithms.rounding == "nearest" for n in nodes
    ):
        return  # the config rounds them otherwise already
    what = f"the '{name}' placement"
    rounded = _rounded(choice, built, build, scorer, name, what, corrected=CORRECTED_INTEGER)
    if rounded is None:
        return
    if validator is not None:
        nearest = next((r.validation for r in reversed(validator.rounds) if r.choice == name), None) or validator(name)
        found = validator.score_model(name, rounded.model, f"{what} with GPTQ-rounded weights")
        if not found.bound_db >= nearest.bound_db:
            validator.rounds.pop()  # not kept: the validations listed are those of the placement kept
            choice.rounding_note = (
                f"{what}'s weights rounded by GPTQ validated at {found.bound_db:.2f} dB, under "
                f"{nearest.bound_db:.2f} dB rounded to nearest: kept to nearest"
            )
            return
        choice.validations = list(validator.rounds)
    _adopt(choice, built, rounded)
    corrected = ", their biases corrected" if rounded.corrected else ""
    choice.rounding_note = (
        f"{what} runs integer kernels: its weights are rounded by GPTQ{corrected} "
        f"({rounded.nearest_db:.2f} -> {rounded.score_db:.2f} dB on the scored samples)"
    )


def _rounded(
    choice: PlacementChoice,
    built: BuiltCandidates,
    build: CandidateBuilder,
    scorer: OutputScorer,
    name: CandidateName,
    what: str = "storage-only",
    corrected: bool = True,
) -> Rounded | None:
    """Placement ``name`` rebuilt with GPTQ rounding and scored, or None (no node rounds, or it scores no higher).

    ``corrected``: each bias also takes away the mean output shift its weight's rounding leaves.
    """
    if built.configs[name].auto_rounding:
        return None
    with stage(f"{what}'s weights rounded by GPTQ"):
        plan, model = build(replace(built.configs[name], auto_rounding="gptq", auto_bias_correction=corrected))
        if not any(n.weight is not None and n.scheme.algorithms.rounding == "gptq" for n in plan.every_node()):
            return None  # no node the choice places rounds by GPTQ
        nearest, score = built.scores[name], scorer.score(model, f"{what} with GPTQ-rounded weights").worst_db
    if not score > nearest:
        choice.rounding_note = (
            f"{what}'s weights rounded by GPTQ{' (biases corrected)' if corrected else ''} scored {score:.2f} dB, no "
            f"more than rounded to nearest ({nearest:.2f} dB): kept to nearest"
        )
        return None
    return Rounded(name, plan, model, nearest, score, corrected)


def _adopt(choice: PlacementChoice, built: BuiltCandidates, rounded: Rounded) -> None:
    """``rounded`` in place of its candidate rounded to nearest, in every alias of it."""
    name = rounded.name
    for alias in (name, *built.aliases[name]):
        built.configs[alias] = replace(
            built.configs[alias], auto_rounding="gptq", auto_bias_correction=rounded.corrected
        )
    built.plans[name], built.scores[name] = (rounded.plan, rounded.model), rounded.score_db
    built.decodes.pop(name, None)
    built.decode()
    timed = {c.name: {"latency_ms": c.latency_ms} for c in choice.candidates}  # the same graph: the same speed
    choice.candidates = [c.model_copy(update=timed.get(c.name)) for c in built.candidates(choice.target_sqnr_db)]
