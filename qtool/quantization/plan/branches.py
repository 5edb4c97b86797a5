"""The plans of a model's If branches and Loop/Scan bodies: each planned as a model of its own, by the same planner.

Calibration observes a body's tensors on the samples and iterations that run it (see
:func:`qtool.graph.branches.expose`). A body the calibration data never ran (or could not observe) has no
ranges: its nodes keep float activations on their stored weights (storage), and the note says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from weakref import WeakKeyDictionary

import onnx

from qtool.config import QConfig
from qtool.graph.branches import Branch, branch_model, control_bodies, owned_constants
from qtool.graph.index import GraphView
from qtool.quantization.plan.kernels import KernelPrediction, predict_kernels
from qtool.quantization.plan.records import BranchPlan, QuantPlan, StoredWeightPlan
from qtool.quantization.plan.roles import static_elements

Planner = Callable[..., QuantPlan]  # the planner: (model, config, elements, observed=..., body=True) -> plan


def with_branches(
    plan: QuantPlan,
    model: onnx.ModelProto,
    config: QConfig,
    elements: dict[str, int] | None,
    g: GraphView,
    observed: frozenset[str] | None,
    planner: Planner,
) -> QuantPlan:
    """``plan`` with its bodies planned (see the module), and the body weights and notes that follow."""
    branches = plan_branches(model, config, (elements, observed), g, planner)
    if not branches:
        return plan
    owners = {b.branch.owner for b in branches}
    weights = outer_body_weights(plan.body_weights, branches, g)
    skipped = tuple((n, branch_summary(branches, n, weights) if n in owners else why) for n, why in plan.skipped)
    return replace(plan, branches=branches, body_weights=weights, skipped=skipped)


def plan_branches(
    model: onnx.ModelProto,
    config: QConfig,
    sizes: tuple[dict[str, int] | None, frozenset[str] | None],
    g: GraphView,
    planner: Planner,
) -> tuple[BranchPlan, ...]:
    """Each If branch and Loop/Scan body of ``model``'s main graph planned by ``planner`` (see the module).

    ``sizes``: the tensors' per-sample element counts, and the tensors calibration saw (None: not known,
    every body is planned as if it ran).
    """
    elements, observed = sizes
    plans = []
    for branch in control_bodies(model):
        sub, owned = _body_model(model, branch, g)
        # the body's static shapes, where calibration did not size a tensor
        sized = {**static_elements(sub), **elements} if elements is not None else None
        planned = planner(sub, config, sized, observed=observed, body=True)
        ran = observed is None or all(t in observed for t in planned.every_activation())
        if not ran:
            kept = frozenset(n.name for n in planned.every_node())
            quieter = replace(config, sensitive_nodes=config.sensitive_nodes | kept)
            planned = planner(sub, quieter, sized, observed=observed, body=True)
        plans.append(BranchPlan(branch, planned, ran, sub, owned))
    return tuple(plans)


def outer_body_weights(
    weights: tuple[StoredWeightPlan, ...], branches: tuple[BranchPlan, ...], g: GraphView
) -> tuple[StoredWeightPlan, ...]:
    """Of the body weights stored in the main graph, those its branch plans leave there.

    A planned branch quantizes its own constants and those only it reads; a constant it shares with
    another reader stays in the main graph, stored there once as before.
    """
    owners = {b.branch.owner for b in branches}
    moved = {name for b in branches for name in b.owned}
    return tuple(w for w in weights if w.owner not in owners or (w.weight in g.initializers and w.weight not in moved))


def branch_summary(branches: tuple[BranchPlan, ...], owner: str, shared: tuple[StoredWeightPlan, ...] = ()) -> str:
    """What the bodies of If, Loop or Scan ``owner`` became, for the list of nodes kept float."""
    mine = [b for b in branches if b.branch.owner == owner]
    parts = []
    for b in mine:
        nodes = b.plan.every_node()
        integer = sum(1 for n in nodes if n.quantized_inputs)
        loop = b.branch.attribute == "body"
        unseen = "calibration could not observe its iterations" if loop else "the calibration data never ran it"
        state = "" if b.observed else f" ({unseen}: activations float)"
        parts.append(f"{b.branch.attribute} {len(nodes)} quantized, {integer} with integer inputs{state}")
    stored = {w.weight for w in shared if w.owner == owner}
    kept = f"; {len(stored)} weight{'s' if len(stored) > 1 else ''} it shares stored once, outside" if stored else ""
    if len(mine) == 1:
        return "its body is quantized as a model of its own: " + parts[0] + kept
    return "its branches are quantized as models of their own: " + "; ".join(parts) + kept


def every_kernel(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, KernelPrediction]:
    """What onnxruntime is predicted to run for each planned node, the bodies' nodes included."""
    found = dict(predict_kernels(model, plan))
    for branch in plan.branches:
        found.update(every_kernel(branch.model, branch.plan))
    return found


# the bodies of each graph view as models: the placement choice plans many configs over one model revision
_BODY_MODELS: WeakKeyDictionary[GraphView, dict[Branch, tuple[onnx.ModelProto, tuple[str, ...]]]] = WeakKeyDictionary()


def _body_model(model: onnx.ModelProto, branch: Branch, g: GraphView) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """:func:`branch_model` and the constants moved into it, found once per graph view (a model revision)."""
    found = _BODY_MODELS.setdefault(g, {})
    if branch not in found:
        owned = tuple(owned_constants(model, branch, g))
        found[branch] = (branch_model(model, branch, g, owned), owned)
    return found[branch]
