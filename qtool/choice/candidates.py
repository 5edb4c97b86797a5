"""The placement choice's candidates: each name's config, the distinct plans, their scores and decodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx

from qtool.choice.decode import DecodeJudge, decode_bar
from qtool.choice.records import CandidateBuilder, meets
from qtool.config import QConfig
from qtool.evaluation.scoring import OutputScorer
from qtool.quantization.plan.records import QuantPlan
from qtool.schemas.reports.quantize import PlacementCandidate
from qtool.schemes import CandidateName


def signature(plan: QuantPlan) -> tuple[tuple[str, str], ...]:
    """What makes two plans the same placement: each node's name and placement, and the weights stored for float ops."""
    return (
        *((n.name, n.placement) for n in plan.every_node()),
        *((w.weight, "stored") for w in plan.every_stored_weight()),
    )


@dataclass
class BuiltCandidates:
    """The candidates built so far: each name's config, the distinct plans, and which names planned the same."""

    configs: dict[CandidateName, QConfig] = field(default_factory=dict)
    plans: dict[CandidateName, tuple[QuantPlan, onnx.ModelProto]] = field(default_factory=dict)
    aliases: dict[CandidateName, list[CandidateName]] = field(default_factory=dict)  # first of a plan -> the others
    scores: dict[CandidateName, float] = field(default_factory=dict)  # by distinct plan: the worst output's SQNR
    seen: dict[tuple[tuple[str, str], ...], CandidateName] = field(default_factory=dict)
    decodes: dict[CandidateName, float] = field(default_factory=dict)  # decoders: by distinct plan, decode agreement
    judge: DecodeJudge | None = None  # decoders: scores decode agreement
    # built and scored before the candidates (the range choice's all-integer model): name -> config, plan, model, score
    prebuilt: dict[CandidateName, tuple[QConfig, QuantPlan, onnx.ModelProto, float]] = field(default_factory=dict)

    def decode(self) -> None:
        """Decode with every distinct candidate not decoded yet (decoders only)."""
        if self.judge is not None:
            for name, (_, model) in self.plans.items():
                if name not in self.decodes:
                    self.decodes[name] = self.judge.agreement(name, model)

    def bar(self) -> float | None:
        """The decode agreement a candidate must reach (None: not a decoder)."""
        return decode_bar(self.decodes, self.aliases) if self.decodes else None

    def add(self, name: CandidateName, config: QConfig, build: CandidateBuilder) -> QuantPlan:
        """Build ``config``; a plan built before under another name only records the alias."""
        self.configs[name] = config
        prebuilt = self.prebuilt.pop(name, None)
        plan, model = (prebuilt[1], prebuilt[2]) if prebuilt is not None else build(config)
        first = self.seen.setdefault(signature(plan), name)
        if first != name:
            self.aliases[first].append(name)
        else:
            self.plans[name], self.aliases[name] = (plan, model), []
            if prebuilt is not None:
                self.scores[name] = prebuilt[3]
        return plan

    def score(self, scorer: OutputScorer, advance: Callable[[int], None]) -> None:
        """Score every distinct candidate not scored yet."""
        for name, (_, model) in self.plans.items():
            if name not in self.scores:
                self.scores[name] = scorer.score(model, f"the '{name}' placement").worst_db
                advance(1)

    def candidates(self, target: float) -> list[PlacementCandidate]:
        listed = candidate_records(self.plans, self.aliases, self.scores, target)
        bar = self.bar()
        return [
            c.model_copy(
                update={
                    "decode_agreement": self.decodes.get(c.name),
                    "meets_target": c.meets_target and (bar is None or self.decodes.get(c.name, 0.0) >= bar),
                }
            )
            for c in listed
        ]


def candidate_records(
    plans: dict[CandidateName, tuple[QuantPlan, onnx.ModelProto]],
    aliases: dict[CandidateName, list[CandidateName]],
    scores: dict[CandidateName, float],
    target: float,
) -> list[PlacementCandidate]:
    """One record per distinct plan: its node counts, its score and whether it reaches ``target``."""
    return [
        PlacementCandidate(
            name=name,
            same_as=aliases[name],
            integer_nodes=sum(1 for n in plan.every_node() if n.placement in ("integer", "dynamic") and not n.chained),
            # storage nodes, and the weights of bodies and recurrent nodes stored the same way
            storage_nodes=sum(1 for n in plan.every_node() if n.placement == "storage")
            + len(plan.body_weights)
            + len(plan.recurrent_nodes()),
            sqnr_db=scores[name],
            meets_target=meets(scores[name], target),
            chained_nodes=sum(1 for n in plan.every_node() if n.chained),
        )
        for name, (plan, _) in plans.items()
    ]
