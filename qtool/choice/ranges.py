"""The activation range rule the placement candidates are built with, chosen by measurement.

Clipping each tensor to its observer's range (mse: least error for that tensor) is usually right, but
where a network's later layers depend on the values it clips (a detector's residual SiLU stacks), the
observed extremes give the output more decibels; only a measurement tells.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import onnx

from qtool.choice.records import CandidateBuilder
from qtool.config import QConfig, load_config
from qtool.evaluation.scoring import OutputScorer
from qtool.quantization.plan.activations import OBSERVED_EXTREMES, OBSERVER_RANGES
from qtool.quantization.plan.records import QuantPlan


@dataclass(frozen=True)
class RangeChoice:
    """The config with the rule kept, the all-integer placement's worst output under each rule, and its model."""

    config: QConfig
    scores: dict[str, float]
    integer: tuple[QConfig, QuantPlan, onnx.ModelProto, float]  # the winner's config, plan, model and score


def choose_ranges(config: QConfig, build: CandidateBuilder, scorer: OutputScorer) -> RangeChoice | None:
    """The rule the all-integer placement scores higher with (ties keep the observer's); None: no choice.

    An observer the config names other than the default's (``calibration.observer``, or a node's
    ``activation.observer``) is taken at its word: then there is no choice, and a node's own is never
    overridden. A model without 8-bit activations has none either.
    """
    default = load_config(None).calibration
    if (config.calibration.observer, config.calibration.observer_options) != (
        default.observer,
        default.observer_options,
    ):
        return None
    scores: dict[str, float] = {}
    kept: tuple[QConfig, QuantPlan, onnx.ModelProto] | None = None
    for rule in (OBSERVER_RANGES, OBSERVED_EXTREMES):
        integer = replace(config, auto_placement="integer", activation_ranges=rule)
        plan, model = build(integer, keep=False)
        if not any(s.dtype in ("int8", "uint8") for s in plan.every_activation().values()):
            return None
        scores[rule] = scorer.score(model, f"the all-integer placement ({rule} ranges)").worst_db
        if kept is None or scores[rule] > scores[OBSERVER_RANGES]:
            kept = (integer, plan, model)  # the other model is released
        del model
    assert kept is not None  # the loop ran
    return RangeChoice(
        replace(config, activation_ranges=kept[0].activation_ranges), scores, (*kept, max(scores.values()))
    )
