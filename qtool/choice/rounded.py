"""Storage-only with rounded weights: when even storage-only misses the target, GPTQ rounds its weights.

Storage-only computes in float on weights stored at 8 bits, so what it loses is the weights' rounding
alone, and rounding to nearest ignores what each weight is multiplied by. GPTQ rounds each weight
against its node's calibration inputs, so that the node's outputs move least: the same graph with other
codes, so at no cost in speed or size (the default's worst output on held-out samples: PP-OCR recogniser
17.8 -> 26.8 dB, a MobileNetV3 orientation classifier 29.6 -> 39.2 dB, a generated audio front end
32.1 -> 47.1 dB). It costs a float pass over 16 spread samples that sums a lighter Hessian per node
(:data:`~qtool.quantization.algorithms.rounding.node_inputs.LIGHT_PATCHES`) and the rounding itself, so it
is tried only where storage-only misses the target (where the search would otherwise keep whole nodes
float), and kept only where it scores higher.
"""

from __future__ import annotations

from dataclasses import replace

from qtool.choice.candidates import BuiltCandidates
from qtool.choice.move_costs import storage_candidate
from qtool.choice.records import CandidateBuilder, PlacementChoice, meets
from qtool.evaluation.scoring import OutputScorer
from qtool.system.stages import stage


def round_storage(
    choice: PlacementChoice, built: BuiltCandidates, build: CandidateBuilder, scorer: OutputScorer
) -> None:
    """The storage-only candidate rounded by GPTQ, when it misses the target and the rounded weights score higher."""
    name = storage_candidate(built)
    if name is None or meets(built.scores[name], choice.target_sqnr_db) or built.configs[name].auto_rounding:
        return
    rounded = replace(built.configs[name], auto_rounding="gptq")
    with stage("storage-only's weights rounded by GPTQ"):
        plan, model = build(rounded)
        if not any(n.weight is not None and n.scheme.algorithms.rounding == "gptq" for n in plan.every_node()):
            return  # no node the choice places rounds by GPTQ
        nearest, score = built.scores[name], scorer.score(model, "storage-only with GPTQ-rounded weights").worst_db
    if not score > nearest:
        choice.rounding_note = (
            f"storage-only's weights rounded by GPTQ scored {score:.2f} dB, no more than rounded to nearest "
            f"({nearest:.2f} dB): kept to nearest"
        )
        return
    for alias in (name, *built.aliases[name]):
        built.configs[alias] = replace(built.configs[alias], auto_rounding="gptq")
    built.plans[name], built.scores[name] = (plan, model), score
    built.decodes.pop(name, None)
    built.decode()
    choice.candidates = built.candidates(choice.target_sqnr_db)
    choice.rounding_note = (
        f"storage-only misses {choice.target_sqnr_db:g} dB rounded to nearest ({nearest:.2f} dB): its weights are "
        f"rounded by GPTQ ({score:.2f} dB)"
    )
