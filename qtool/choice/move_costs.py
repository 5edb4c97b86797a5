"""What moving one node back to float costs in latency, so the search buys decibels where they are cheap.

The sensitivity search ranks the nodes it may move by the decibels each is expected to buy per
millisecond it loses. The milliseconds are read off the candidates the placement choice timed, on
this machine, with this model:

- an integer node given float activations loses what integer kernels save per multiply-accumulate:
  storage-only's latency minus that of the candidate whose integer nodes run unchained ("unchained",
  else "auto"), over those nodes' MACs;
- a chained op (a SiLU's Sigmoid and Mul, a residual Add, a Concat) moved to float loses what the chain
  saves per element it writes: the unchained candidate's latency minus the chained one's, over the
  elements its chained ops write.

Where a figure cannot be measured (a candidate not built or not timed, or no saving seen), it is set from
the other by :data:`ELEMENT_MACS`, and with neither both are that fixed proportion: the ranking then
weighs nodes by their work alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qtool.choice.candidates import BuiltCandidates
from qtool.choice.records import TIE, FloatModel, PlacementChoice
from qtool.choice.search import FLOAT_ACTIVATIONS, MoveKind, Moves
from qtool.quantization.plan.records import NodePlan, QuantPlan
from qtool.schemes import CandidateName

# Where unmeasured: a chained op's written element costs, in float, what this many integer MACs save (a
# DequantizeLinear, the float op and a QuantizeLinear each pass over it, against a few MACs per int8 cycle)
ELEMENT_MACS = 8.0
UNIT_MS = 1e-6  # per MAC when nothing was measured: the ranking only compares costs with each other


@dataclass(frozen=True)
class MoveCosts:
    """Milliseconds lost per MAC of an integer node and per element of a chained op moved to float."""

    per_mac_ms: float
    per_element_ms: float
    measured: str  # what was measured: "macs and chains", "macs", "chains" or "" (the fixed proportion)

    def of(self, node: NodePlan, elements: Mapping[str, int]) -> float:
        """The estimated milliseconds ``node`` loses in float (0 when its work is unknown)."""
        if node.chained:
            return self.per_element_ms * sum(elements.get(t, 0) for t in _written(node))
        return self.per_mac_ms * (node.macs or 0)


def move_costs(
    choice: PlacementChoice, plans: Mapping[CandidateName, QuantPlan], elements: Mapping[str, int]
) -> MoveCosts:
    """The costs read off the timed candidates of ``choice`` (``plans``: each distinct candidate's plan)."""
    latency = {c.name: c.latency_ms for c in choice.candidates if c.latency_ms is not None}
    per_mac = per_element = None
    unchained = next((n for n in ("unchained", "auto") if n in plans and n in latency), None)
    macs = _integer_macs(plans[unchained]) if unchained is not None else 0
    if unchained is not None and "storage" in latency and macs > 0:
        saved = latency["storage"] - latency[unchained]
        per_mac = saved / macs if saved > 0 else None
    if "auto" in plans and "unchained" in latency and "auto" in latency:
        written = sum(elements.get(t, 0) for n in plans["auto"].every_node() if n.chained for t in _written(n))
        saved = latency["unchained"] - latency["auto"]
        per_element = saved / written if saved > 0 and written > 0 else None
    measured = " and ".join(w for w, v in (("macs", per_mac), ("chains", per_element)) if v is not None)
    if per_mac is None:
        per_mac = per_element / ELEMENT_MACS if per_element is not None else UNIT_MS
    if per_element is None:
        per_element = per_mac * ELEMENT_MACS
    return MoveCosts(per_mac, per_element, measured)


def _written(node: NodePlan) -> tuple[str, ...]:
    return (node.output,) if node.output else node.activations


def _integer_macs(plan: QuantPlan) -> int:
    return sum(n.macs or 0 for n in plan.every_node() if n.placement == "integer" and not n.chained)


def priced_moves(
    choice: PlacementChoice, built: BuiltCandidates, float_model: FloatModel, start: CandidateName, kind: MoveKind
) -> Moves:
    """Float activations priced by the latency each node's move is estimated to cost (see move_costs).

    Their budget: what the start may lose and still run more than :data:`TIE` faster than storage-only, which
    reaches the target (a slower placement is never kept over it: storage-only is more accurate).
    """
    if kind != FLOAT_ACTIVATIONS:  # moving whole nodes float: priced by their size instead
        return Moves(kind)
    costs = move_costs(choice, {name: plan for name, (plan, _) in built.plans.items()}, float_model.elements)
    by_node = {n.name: costs.of(n, float_model.elements) for n in built.plans[start][0].nodes}
    measured = f"the candidates' latencies ({costs.measured})" if costs.measured else "each node's work"
    latency = {c.name: c.latency_ms for c in choice.candidates if c.latency_ms is not None}
    storage = storage_candidate(built)
    budget = None
    if costs.measured and storage in latency and start in latency:
        budget = (1 - TIE) * latency[storage] - latency[start]
    return Moves(kind, by_node, measured, budget)


def storage_candidate(built: BuiltCandidates) -> CandidateName | None:
    """The candidate that plans storage-only (it, or another that planned the same model), if any."""
    return next((n for n, a in built.aliases.items() if n == "storage" or "storage" in a), None)
