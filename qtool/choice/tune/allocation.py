"""Pick one option per node: the cheapest set whose predicted error fits a budget (a Lagrangian knapsack).

For a multiplier ``lam`` every node takes the option minimising ``cost + lam * nsr`` on its own;
raising ``lam`` trades cost for accuracy, node by node, in order of the best exchange rate. A
bisection on ``lam`` finds the cheapest such allocation whose summed noise-to-signal power stays
within the budget. Costs are bytes (objective ``size``) or predicted time (objective ``latency``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence

from qtool.choice.tune.sensitivity import Sensitivity

Allocation = dict[str, str]  # node -> option name


def _pick(
    nodes: Sequence[str], options: Sequence[str], cost: Mapping[str, Mapping[str, float]], sens: Sensitivity, lam: float
) -> Allocation:
    chosen = {}
    for node in nodes:
        usable = [o for o in options if math.isfinite(sens.of(node, o)) and o in cost[node]]
        chosen[node] = min(usable, key=lambda o: (cost[node][o] + lam * sens.of(node, o), sens.of(node, o), o))
    return chosen


def predicted_nsr(allocation: Allocation, sens: Sensitivity) -> float:
    """The allocation's summed noise-to-signal power."""
    return sum(sens.of(node, option) for node, option in allocation.items())


def allocate(
    nodes: Sequence[str],
    options: Sequence[str],
    cost: Mapping[str, Mapping[str, float]],
    sens: Sensitivity,
    budget: float,
) -> Allocation:
    """The cheapest allocation (by the Lagrangian) whose predicted noise fits ``budget``."""
    if "float" not in options:
        raise ValueError("the options must include float (the allocation that always fits)")
    low, high = 1e-6, 1e18  # lam: low buys the cheapest options, high the most accurate
    best = _pick(nodes, options, cost, sens, high)
    if predicted_nsr(best, sens) > budget:
        return best
    cheapest = _pick(nodes, options, cost, sens, low)
    if predicted_nsr(cheapest, sens) <= budget:
        return cheapest
    for _ in range(80):
        middle = math.sqrt(low * high)
        trial = _pick(nodes, options, cost, sens, middle)
        if predicted_nsr(trial, sens) <= budget:
            high, best = middle, trial
        else:
            low = middle
        if high / low < 1.0001:
            break
    return best


Rate = Callable[[str, str, str], float | None]  # (node, current, option) -> exchange rate; None: not a step


def _best_steps(allocation: Allocation, options: Sequence[str], rate: Rate) -> list[tuple[str, str]]:
    """For each node, the option with the highest ``rate`` from where it is; best steps first."""
    found = []
    for node, current in allocation.items():
        rated = [(r, option) for option in options if (r := rate(node, current, option)) is not None]
        if rated:
            best = max(rated, key=lambda ro: ro[0])  # the first of equal rates, in ``options`` order
            found.append((best[0], node, best[1]))
    return [(node, option) for _, node, option in sorted(found, key=lambda f: (-f[0], f[1]))]


def cheaper_moves(
    allocation: Allocation,
    options: Sequence[str],
    cost: Mapping[str, Mapping[str, float]],
    sens: Sensitivity,
    rejected: Collection[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """For each node, the cheaper option that saves the most cost per unit of added noise; best exchanges first.

    Steps in ``rejected`` (verified to break the target) are passed over, so a node whose best step
    broke it offers its next best.
    """

    def saved_per_noise(node: str, current: str, option: str) -> float | None:
        if option not in cost[node] or cost[node][option] >= cost[node][current] or (node, option) in rejected:
            return None
        if not math.isfinite(sens.of(node, option)):
            return None
        added = sens.of(node, option) - sens.of(node, current)
        return (cost[node][current] - cost[node][option]) / max(added, 1e-12)

    return _best_steps(allocation, options, saved_per_noise)


def costlier_moves(
    allocation: Allocation, options: Sequence[str], cost: Mapping[str, Mapping[str, float]], sens: Sensitivity
) -> list[tuple[str, str]]:
    """For each node, the costlier option that removes the most noise per unit of added cost; best first."""

    def removed_per_cost(node: str, current: str, option: str) -> float | None:
        if option not in cost[node] or cost[node][option] <= cost[node][current]:
            return None
        removed = sens.of(node, current) - sens.of(node, option)
        if not removed > 0:  # no less noise (or the current option fails and so does this one)
            return None
        return removed / (cost[node][option] - cost[node][current])

    return _best_steps(allocation, options, removed_per_cost)
