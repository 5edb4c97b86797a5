"""The tune allocation: the cheapest precisions whose predicted noise fits the budget."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from qtool.choice.tune.allocation import allocate, predicted_nsr
from qtool.choice.tune.loop import Trial, best_trial, pareto, search_budgets
from qtool.choice.tune.sensitivity import Sensitivity, measure, nsr, sqnr_db
from qtool.choice.tune.space import FP16_NSR, INT16_GAIN, options_for

OPTIONS = ["w4", "w8", "fp16", "float"]
BYTES = {"w4": 0.625, "w8": 1.0, "fp16": 2.0, "float": 4.0}


def _instance(seed: int, nodes: int = 5) -> tuple[list[str], dict, Sensitivity]:
    rng = np.random.default_rng(seed)
    names = [f"n{i}" for i in range(nodes)]
    sizes = rng.integers(100, 10_000, nodes)
    sens = Sensitivity()
    for name in names:
        w8 = float(10 ** rng.uniform(-6, -3))
        sens.nsr[name] = {"w4": w8 * float(rng.uniform(50, 400)), "w8": w8, "fp16": 1e-7, "float": 0.0}
    costs = {n: {o: BYTES[o] * int(s) for o in OPTIONS} for n, s in zip(names, sizes, strict=True)}
    return names, costs, sens


@pytest.mark.parametrize("seed", range(12))
def test_the_allocation_fits_the_budget_and_is_near_the_cheapest_that_does(seed):
    names, costs, sens = _instance(seed)
    budget = float(10 ** np.random.default_rng(seed + 100).uniform(-4, -2))
    chosen = allocate(names, OPTIONS, costs, sens, budget)
    assert predicted_nsr(chosen, sens) <= budget
    cost = sum(costs[n][o] for n, o in chosen.items())
    fitting = [
        sum(costs[n][o] for n, o in zip(names, combo, strict=True))
        for combo in itertools.product(OPTIONS, repeat=len(names))
        if sum(sens.of(n, o) for n, o in zip(names, combo, strict=True)) <= budget
    ]
    # the Lagrangian finds the convex hull's points: never more than the next one up from the optimum
    assert cost <= 1.35 * min(fitting)


def test_a_budget_nothing_fits_keeps_every_node_float():
    names, costs, sens = _instance(0)
    chosen = allocate(names, OPTIONS, costs, sens, budget=0.0)
    assert set(chosen.values()) == {"float"}


def test_options_that_fail_on_a_node_are_never_chosen():
    names, costs, sens = _instance(1)
    sens.nsr["n0"]["w4"] = math.inf
    chosen = allocate(names, OPTIONS, costs, sens, budget=1.0)
    assert chosen["n0"] != "w4" and all(o == "w4" for n, o in chosen.items() if n != "n0")


def test_unmeasured_options_are_derived_and_unmeasured_nodes_take_the_worst_figures():
    scores = {("a", "w2"): 3.0, ("b", "w2"): 1.0}
    scores |= {("a", "w4"): 20.0, ("a", "w4g"): 23.0, ("a", "w8"): 45.0, ("a", "w8g"): 47.0}
    scores |= {("a", "w8b"): 47.0, ("a", "w8bg"): 49.0, ("a", "w8a8"): 40.0}
    scores |= {("b", "w4"): 10.0, ("b", "w4g"): 9.0, ("b", "w8"): 35.0, ("b", "w8g"): 36.0}
    scores |= {("b", "w8b"): 38.0, ("b", "w8bg"): 40.0, ("b", "w8a8"): 33.0}
    seen = []

    def score(selection):
        ((node, option),) = selection.items()
        seen.append(node)
        return scores[(node, option.name)]

    sens = measure(["a", "b"], options_for("cpu"), score)
    assert sens.complete and sens.builds == 16
    # int2 measured, as the int4 and int8 options are
    assert sens.of("a", "w2") == pytest.approx(nsr(3.0)) and sens.of("b", "w2") == pytest.approx(nsr(1.0))
    assert sens.of("a", "w8a16") == pytest.approx(nsr(45.0) + (nsr(40.0) - nsr(45.0)) * INT16_GAIN)
    assert sens.of("a", "fp16") == FP16_NSR and sens.of("a", "float") == 0.0
    cut = measure(["a", "b", "c"], options_for("cpu"), score, deadline=-math.inf)
    assert not cut.complete and cut.measured["c"] == [] and seen[-1] in ("a", "b")
    assert cut.of("c", "w8") == max(cut.of("a", "w8"), cut.of("b", "w8")) or cut.of("c", "w8") == math.inf


def test_tensorrt_gets_only_integer_kernels_or_float():
    assert [o.name for o in options_for("tensorrt")] == ["w8a8", "float"]
    assert "w8a8" not in [o.name for o in options_for("cuda")]


def _trial(size: int, sqnr: float, meets: bool, latency: float | None = None) -> Trial:
    return Trial({}, sqnr, size, 100 / size, sqnr, latency_ratio=latency, meets=meets)


def test_the_smallest_or_fastest_qualifying_trial_wins_and_the_front_drops_dominated_ones():
    trials = [
        _trial(10, 31, True, 1.1),
        _trial(8, 29, False, 0.9),
        _trial(12, 35, True, 0.95),
        _trial(12, 30, True, 1.2),
    ]
    assert best_trial(trials, "size") is trials[0]
    assert best_trial(trials, "latency") is trials[2]
    assert trials[3] not in pareto(trials) and {id(t) for t in trials[:3]} == {id(t) for t in pareto(trials)}


def test_the_budget_moves_until_the_largest_that_meets_is_pinned_down():
    # a fake model: measured SQNR = predicted budget in dB + 3 (the sum is pessimistic by 3 dB)
    tried = []

    def verify(allocation, budget):
        tried.append(budget)
        measured = sqnr_db(budget) + 3
        return Trial(dict(allocation), sqnr_db(budget), int(100 * measured), 1.0, measured, meets=measured >= 30)

    search = search_budgets(
        nsr(30), lambda b: {"n": f"{b:.6g}"}, verify, lambda t: t.sqnr_db - 30, deadline=math.inf, max_trials=10
    )
    best = best_trial(search.trials, "size")
    assert best is not None and 30 <= best.sqnr_db < 32  # within the last bisection step (1.76 dB)
    assert not search.out_of_time and len(search.trials) <= 10


def test_refinement_keeps_cheaper_steps_only_while_the_target_holds():
    from qtool.choice.tune.allocation import cheaper_moves
    from qtool.choice.tune.loop import refine

    names, costs, sens = _instance(3, nodes=6)
    start_allocation = {n: "fp16" for n in names}
    limit = 2e-3
    verified = []

    def verify(allocation):
        verified.append(dict(allocation))
        size = int(sum(costs[n][o] for n, o in allocation.items()))
        noise = predicted_nsr(allocation, sens)
        return Trial(dict(allocation), sqnr_db(noise), size, 1.0, sqnr_db(noise), meets=noise <= limit)

    start = verify(start_allocation)
    search = refine(
        start,
        lambda a, rejected: cheaper_moves(a, OPTIONS, costs, sens, rejected),
        verify,
        deadline=math.inf,
        max_trials=100,
    )
    kept = best_trial([start, *search.trials], "size")
    assert kept is not None and kept.meets and kept.size_bytes < start.size_bytes
    # no single cheaper step from the result still meets the target: not the best one of each node, nor any other
    for node, current in kept.allocation.items():
        for option in OPTIONS:
            if option in costs[node] and costs[node][option] < costs[node][current]:
                assert predicted_nsr({**kept.allocation, node: option}, sens) > limit, (node, option)
    assert len({tuple(sorted(a.items())) for a in verified}) == len(verified)  # nothing verified twice


def test_size_alone_never_measures_options_that_only_add_activation_noise():
    from qtool.choice.tune.space import for_objective

    cpu = options_for("cpu")
    sized = [o.name for o in for_objective(cpu, timed=False)]
    assert "w8" in sized and not {"w8a8", "w8a16"} & set(sized)
    assert [o.name for o in for_objective(cpu, timed=True)] == [o.name for o in cpu]
    # TensorRT has no weight-only option: its integer nodes stay whatever the objective
    assert [o.name for o in for_objective(options_for("tensorrt"), timed=False)] == ["w8a8", "float"]


def test_a_node_whose_best_step_breaks_the_target_offers_its_next_one():
    from qtool.choice.tune.allocation import cheaper_moves
    from qtool.choice.tune.loop import refine

    # w4 saves the most per unit of noise but breaks the 5e-4 budget; w8 saves less and fits
    costs = {"a": {"w4": 25.0, "w8": 100.0, "fp16": 200.0}}
    sens = Sensitivity({"a": {"w4": 6e-4, "w8": 4e-4, "fp16": 0.0}})

    def verify(allocation):
        noise = predicted_nsr(allocation, sens)
        size = int(sum(costs[n][o] for n, o in allocation.items()))
        return Trial(dict(allocation), sqnr_db(noise), size, 1.0, sqnr_db(noise), meets=noise <= 5e-4)

    assert cheaper_moves({"a": "fp16"}, ["w4", "w8", "fp16"], costs, sens)[0] == ("a", "w4")
    search = refine(
        verify({"a": "fp16"}),
        lambda a, rejected: cheaper_moves(a, ["w4", "w8", "fp16"], costs, sens, rejected),
        verify,
        deadline=math.inf,
        max_trials=10,
    )
    assert [t.allocation["a"] for t in search.trials] == ["w4", "w8"]
    assert best_trial(search.trials, "size").allocation == {"a": "w8"}


def test_a_missed_allocation_is_never_chosen_again_however_small_the_slack():
    # the allocation "a" predicts 40 dB (1e-4) and fits every budget above that, yet measures 29.9 dB:
    # the next budget must fall below its predicted noise, so that "b" (more accurate) is tried
    def allocate(budget: float) -> dict[str, str]:
        return {"n": "a"} if budget >= 1e-4 else {"n": "b"}

    def verify(allocation: dict[str, str], budget: float) -> Trial:
        measured = 29.9 if allocation["n"] == "a" else 33.0
        predicted = 40.0 if allocation["n"] == "a" else 45.0
        return Trial(allocation, predicted, 10, 1.0, measured, meets=measured >= 30)

    search = search_budgets(1e-3, allocate, verify, lambda t: t.sqnr_db - 30, deadline=math.inf)
    assert [t.allocation["n"] for t in search.trials] == ["a", "b"]


def test_a_restart_from_one_node_made_more_accurate_finds_what_the_descent_could_not():
    from qtool.choice.tune.allocation import cheaper_moves, costlier_moves
    from qtool.choice.tune.loop import refine

    # "a" is small and noisy at int8; "b" and "c" are large: each fits at int4 only once "a" is fp16
    costs = {"a": {"w8": 10.0, "fp16": 20.0}, "b": {"w4": 25.0, "w8": 100.0}, "c": {"w4": 25.0, "w8": 100.0}}
    sens = Sensitivity(
        {"a": {"w8": 3e-4, "fp16": 0.0}, "b": {"w4": 2.5e-4, "w8": 0.5e-4}, "c": {"w4": 2.5e-4, "w8": 0.5e-4}}
    )
    verified = []

    def verify(allocation):
        verified.append(tuple(sorted(allocation.items())))
        noise = predicted_nsr(allocation, sens)
        size = int(sum(costs[n][o] for n, o in allocation.items()))
        return Trial(dict(allocation), sqnr_db(noise), size, 1.0, sqnr_db(noise), meets=noise <= 5e-4 + 1e-12)

    options = ["w4", "w8", "fp16"]
    start = verify({"a": "w8", "b": "w8", "c": "w8"})
    assert costlier_moves(start.allocation, options, costs, sens)[0] == ("a", "fp16")

    def run(**restarts):
        moves = lambda a, rejected: cheaper_moves(a, options, costs, sens, rejected)  # noqa: E731
        search = refine(start, moves, verify, deadline=math.inf, max_trials=20, **restarts)
        return best_trial([start, *search.trials], "size")

    assert run().size_bytes == 210  # the descent alone: every cheaper step breaks the target
    before = len(verified)
    restarted = run(upgrades=lambda a: costlier_moves(a, options, costs, sens), restart_trials=5)
    assert restarted.allocation == {"a": "fp16", "b": "w4", "c": "w4"} and restarted.size_bytes == 70
    assert len(set(verified[before:])) == len(verified[before:])  # nothing verified twice


def test_the_margin_rises_by_the_shortfall_then_bisects_between_a_miss_and_a_pass():
    from qtool.choice.tune.loop import Margins

    margins = Margins(step=0.25, resolution=0.5)
    assert margins.margin == 0.0
    margins.update(False, 8.0)  # the first choice missed by 8 dB on the validation samples
    assert margins.margin == pytest.approx(8.25)
    margins.update(True, 0.0)  # that one passed: try halfway, a smaller model may pass too
    assert margins.margin == pytest.approx(4.125)
    margins.update(False, 1.0)
    assert margins.margin == pytest.approx((4.125 + 8.25) / 2)
    rounds = 0
    while margins.margin is not None:  # every choice from here passes: halving down toward the miss
        margins.update(True, 0.0)
        rounds += 1
    assert margins.passed is not None and margins.missed == pytest.approx(4.125)
    assert margins.passed - margins.missed < 0.5 and rounds == 4  # close enough: stop
    # the first choice passed: nothing smaller to look for
    first = Margins(step=0.25, resolution=0.5)
    first.update(True, 0.0)
    assert first.margin is None
    # a metric goal: no bisection, the shortfall alone (in the metric's units)
    metric = Margins(step=0.25, resolution=0.5)
    metric.update(False, 0.02, bisect=False)
    assert metric.margin == pytest.approx(0.02)
    metric.update(True, 0.0, bisect=False)
    assert metric.margin is None
    # a miss with no shortfall to move by (an undefined bound) ends the search instead of retrying one margin
    stuck = Margins(step=0.25, resolution=0.5)
    stuck.update(False, 0.0, bisect=False)
    assert stuck.margin is None


def test_a_metric_goal_raises_its_bar_by_the_selection_margin():
    from qtool.choice.tune.candidates import Goal

    decode = Goal(metric_name="free-running agreement (16 steps)", target_metric=0.9, decode_steps=16)
    assert decode.by_metric and decode.describe() == "free-running agreement (16 steps) >= 0.9"
    assert decode.accuracy_met(0.0, 0.92) and not decode.accuracy_met(0.0, 0.88)
    raised = Goal(metric_name="d", target_metric=0.9, decode_steps=16, margin_db=0.05)
    assert not raised.accuracy_met(0.0, 0.92) and raised.accuracy_met(0.0, 0.92, margin=False)
    assert raised.shortfall(0.0, 0.85) == pytest.approx(0.05)
    capped = Goal(metric_name="d", target_metric=0.9, decode_steps=16, margin_db=0.3)
    assert capped.accuracy_met(0.0, 1.0) and not capped.accuracy_met(0.0, 0.99)  # agreement cannot pass 1
    error = Goal(metric=abs, metric_name="err", target_metric=0.1, lower_is_better=True, margin_db=0.02)
    assert error.accuracy_met(0.0, 0.07) and not error.accuracy_met(0.0, 0.09)
