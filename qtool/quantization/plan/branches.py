"""The plans of a model's If branches: each branch planned as a model of its own, by the same planner.

Calibration observes a branch's tensors on the samples that run it (see
:func:`qtool.calibration.statistics.with_exposed_outputs`). A branch the calibration data never ran has no
ranges: its nodes keep float activations on their stored weights (storage), and the note says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import onnx

from qtool.config import QConfig
from qtool.graph.branches import branch_model, if_branches, owned_constants
from qtool.graph.index import GraphView
from qtool.quantization.plan.kernels import KernelPrediction, predict_kernels
from qtool.quantization.plan.records import BodyWeightPlan, BranchPlan, QuantPlan
from qtool.quantization.plan.roles import static_elements

Planner = Callable[..., QuantPlan]  # the planner: (model, config, elements, observed=...) -> plan


def with_branches(
    plan: QuantPlan,
    model: onnx.ModelProto,
    config: QConfig,
    elements: dict[str, int] | None,
    g: GraphView,
    observed: frozenset[str] | None,
    planner: Planner,
) -> QuantPlan:
    """``plan`` with its If branches planned (see the module), and the body weights and notes that follow."""
    branches = plan_branches(model, config, (elements, observed), g, planner)
    if not branches:
        return plan
    owners = {b.branch.owner for b in branches}
    skipped = tuple((n, branch_summary(branches, n) if n in owners else why) for n, why in plan.skipped)
    weights = outer_body_weights(plan.body_weights, model, branches, g)
    return replace(plan, branches=branches, body_weights=weights, skipped=skipped)


def plan_branches(
    model: onnx.ModelProto,
    config: QConfig,
    sizes: tuple[dict[str, int] | None, frozenset[str] | None],
    g: GraphView,
    planner: Planner,
) -> tuple[BranchPlan, ...]:
    """Each If branch of ``model``'s main graph planned by ``planner`` (see the module).

    ``sizes``: the tensors' per-sample element counts, and the tensors calibration saw (None: not known,
    every branch is planned as if it ran).
    """
    elements, observed = sizes
    plans = []
    for branch in if_branches(model):
        sub = branch_model(model, branch, g)
        # the branch's static shapes, where calibration did not size a tensor
        sized = {**static_elements(sub), **elements} if elements is not None else None
        planned = planner(sub, config, sized, observed=observed)
        ran = observed is None or all(t in observed for t in planned.every_activation())
        if not ran:
            kept = frozenset(n.name for n in planned.every_node())
            quieter = replace(config, sensitive_nodes=config.sensitive_nodes | kept)
            planned = planner(sub, quieter, sized, observed=observed)
        plans.append(BranchPlan(branch, planned, ran))
    return tuple(plans)


def outer_body_weights(
    weights: tuple[BodyWeightPlan, ...], model: onnx.ModelProto, branches: tuple[BranchPlan, ...], g: GraphView
) -> tuple[BodyWeightPlan, ...]:
    """Of the body weights stored in the main graph, those its branch plans leave there.

    A planned branch quantizes its own constants and those only it reads; a constant it shares with
    another reader stays in the main graph, stored there once as before.
    """
    owners = {b.branch.owner for b in branches}
    moved = {name for b in branches for name in owned_constants(model, b.branch, g)}
    return tuple(w for w in weights if w.owner not in owners or (w.weight in g.initializers and w.weight not in moved))


def branch_summary(branches: tuple[BranchPlan, ...], owner: str) -> str:
    """What the branches of If ``owner`` became, for the list of nodes kept float."""
    mine = [b for b in branches if b.branch.owner == owner]
    parts = []
    for b in mine:
        nodes = b.plan.every_node()
        integer = sum(1 for n in nodes if n.quantized_inputs)
        state = "" if b.observed else " (the calibration data never ran it: activations float)"
        parts.append(f"{b.branch.attribute} {len(nodes)} quantized, {integer} with integer inputs{state}")
    return "its branches are quantized as models of their own: " + "; ".join(parts)


def every_kernel(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, KernelPrediction]:
    """What onnxruntime is predicted to run for each planned node, the If branches' nodes included."""
    found = dict(predict_kernels(model, plan))
    view = GraphView(model) if plan.branches else None
    for branch in plan.branches:
        found.update(every_kernel(branch_model(model, branch.branch, view), branch.plan))
    return found
