"""The sensitivity search's ranking (the movable nodes that add error, largest drop first) and its stop rules."""

from __future__ import annotations

import time

import numpy as np
import pytest

from qtool.choice.records import PlacementChoice
from qtool.choice.search import Moves, SearchResult, _stop_reason, rank_nodes
from qtool.choice.selection import _may_win
from qtool.schemas.reports.compare import Layer
from qtool.schemas.reports.quantize import SearchStep
from tests.choice.records import candidate


def _row(node: str, sqnr: float, source: float, position: int) -> Layer:
    figures = {"sqnr_db": sqnr, "mse": 0.0, "cosine": 1.0, "input_sqnr_db": source, "drop_db": source - sqnr}
    return Layer(tensor=node + ":out", node=node, op_type="Conv", **figures, position=position, source_sqnr_db=source)


def test_movable_nodes_are_ranked_by_the_error_they_add_with_their_inputs():
    rows = [_row("a", 40.0, 60.0, 0), _row("b", 20.0, 50.0, 1), _row("c", 35.0, 45.0, 2), _row("d", 10.0, 60.0, 3)]
    ranked = rank_nodes(rows, movable={"a", "b", "c"})
    assert [r.node for r in ranked] == ["b", "a", "c"]  # drops 30, 20, 10; d is not movable


def test_with_move_costs_the_nodes_that_matter_are_ranked_by_decibels_per_millisecond():
    # drops 30, 20, 12, 5 dB; "b" costs a tenth of "a"'s time: 200 dB/ms against 30
    rows = [_row("a", 30.0, 60.0, 0), _row("b", 40.0, 60.0, 1), _row("c", 48.0, 60.0, 2), _row("d", 55.0, 60.0, 3)]
    costs = {"a": 1.0, "b": 0.1, "c": 0.01, "d": 0.0001}
    ranked = rank_nodes(rows, {"a", "b", "c", "d"}, costs)
    # c (1200 dB/ms) before b (200) before a (30); d's drop is under a quarter of the largest: after them, by drop
    assert [r.node for r in ranked] == ["c", "b", "a", "d"]
    # a node whose work is unknown (cost 0) counts as the cheapest priced one; equal ratios go by drop
    # (b: 20 dB over c's 0.5 ms, 40 dB/ms; a 30; c 24), and equal ratios go by drop
    assert [r.node for r in rank_nodes(rows[:3], {"a", "b", "c"}, {"a": 1.0, "c": 0.5})] == ["b", "a", "c"]
    assert [r.node for r in rank_nodes(rows[:2], {"a", "b"}, {"a": 0.3, "b": 0.2})] == ["a", "b"]


def test_move_costs_are_read_off_the_timed_candidates():
    from qtool.choice.move_costs import ELEMENT_MACS, move_costs
    from qtool.quantization.plan.records import NodePlan

    def node(name: str, macs: int | None, chained: bool = False) -> NodePlan:  # chained: an unweighted Mul
        op = "Mul" if chained else "Conv"
        return NodePlan(name, op, None, ("x",), None, None, name + ":out", "integer", "", macs)  # type: ignore[arg-type]

    class Plan:
        def __init__(self, *nodes: NodePlan) -> None:
            self.nodes = list(nodes)

        def every_node(self) -> list[NodePlan]:
            return self.nodes

    auto, unchained = Plan(node("conv", 1000), node("silu", None, chained=True)), Plan(node("conv", 1000))
    elements = {"silu:out": 50}

    def choice(**ms: float) -> PlacementChoice:
        candidates = [candidate(n, 1, 0, 25.0, False, v) for n, v in ms.items()]  # type: ignore[arg-type]
        return PlacementChoice(30.0, [], 1, candidates, "auto", "")

    costs = move_costs(choice(auto=6.0, unchained=7.0, storage=9.0), {"auto": auto, "unchained": unchained}, elements)
    assert costs.measured == "macs and chains"
    assert costs.per_mac_ms == pytest.approx(2.0 / 1000) and costs.per_element_ms == pytest.approx(1.0 / 50)
    assert costs.of(auto.nodes[0], elements) == pytest.approx(2.0) and costs.of(auto.nodes[1], elements) == 1.0
    # chains no faster than unchained: their figure comes from the MACs' by the fixed proportion
    slow = move_costs(choice(auto=7.5, unchained=7.0, storage=9.0), {"auto": auto, "unchained": unchained}, elements)
    assert slow.measured == "macs" and slow.per_element_ms == pytest.approx(slow.per_mac_ms * ELEMENT_MACS)
    # nothing timed: the fixed proportion alone
    untimed = move_costs(PlacementChoice(30.0, [], 1, [], "auto", ""), {"auto": auto}, elements)
    assert untimed.measured == "" and untimed.per_element_ms == pytest.approx(untimed.per_mac_ms * ELEMENT_MACS)


def test_a_node_that_adds_no_error_is_not_ranked_and_each_node_counts_once():
    rows = [_row("a", 50.0, 50.0, 0), _row("b", 30.0, 40.0, 1), _row("b", 20.0, 40.0, 2)]
    ranked = rank_nodes(rows, movable={"a", "b"})
    assert [(r.node, r.position) for r in ranked] == [("b", 2)]  # its larger drop


def test_the_search_stops_when_the_nodes_left_cannot_close_the_gap_once_one_helped():
    result = SearchResult(30.0, 4, 8, 20.0, 20.5)
    result.steps.append(
        SearchStep(node="a", op_type="Conv", drop_db=6.0, sqnr_db=20.5, kept=True)
    )  # +0.5 dB: 3 more at that rate reach 22
    assert _stop_reason(result, 20.5, 0, 1.0, 60.0, best_gain=0.5).startswith("out of reach")
    assert _stop_reason(result, 20.5, 0, 1.0, 60.0, best_gain=4.0) == ""  # 3 x 4 dB could close 9.5 dB
    masked = SearchResult(30.0, 4, 8, 20.0, 20.0)
    masked.steps.append(
        SearchStep(node="a", op_type="Conv", drop_db=6.0, sqnr_db=20.0, kept=False)
    )  # no gain yet: another node may mask it
    assert _stop_reason(masked, 20.0, 1, 1.0, 60.0, best_gain=0.0) == ""


def test_only_a_search_candidate_that_could_be_kept_is_timed_again():
    def choice(search_db: float, storage_db: float) -> PlacementChoice:
        scores = {"storage": storage_db, "search": search_db}
        candidates = [candidate(n, 1, 0, db, db >= 30.0) for n, db in scores.items()]
        return PlacementChoice(30.0, [], 1, candidates, "storage", "")

    assert _may_win(choice(31.0, 32.0), "search")  # reaches the target
    assert not _may_win(choice(25.0, 32.0), "search")  # storage reaches it, the search does not
    assert _may_win(choice(25.0, 20.0), "search")  # none reaches it: the most accurate is kept


def _fake_trials(gains: dict[str, float], start: float, target: float, price: dict[str, float]) -> list[str]:
    """The nodes _try_in_float keeps when moving each node alone adds ``gains[node]`` decibels."""
    from dataclasses import replace as copy

    from qtool.choice.search import FLOAT, _try_in_float
    from qtool.config import load_config

    config = load_config(None)
    config = copy(config, accuracy=copy(config.accuracy, target_sqnr_db=target, max_float_nodes=4))
    result = SearchResult(target, 4, 8, start, start, moves=FLOAT)
    ranking = [_row(n, 0.0, 1.0, i) for i, n in enumerate(gains)]

    class Scorer:
        def score(self, model: object) -> object:
            total = start + sum(gains[n] for n in model)  # type: ignore[attr-defined]
            return type("Score", (), {"worst_db": total, "worst_bound_db": lambda self: total})()

    def quantize(cfg: object) -> tuple[object, set[str]]:
        return set(cfg.float_nodes), set()  # type: ignore[attr-defined]

    _try_in_float(config, ranking, quantize, Scorer(), result, (time.perf_counter(), lambda _: None), (price, Moves()))  # type: ignore[arg-type]
    return result.kept_nodes


def test_a_node_kept_float_short_of_the_target_must_buy_a_gain_worth_its_size():
    # 0.26 dB for a node that adds a fifth of the file (price 2 dB) is refused; 3 dB for it is kept
    assert _fake_trials({"big": 0.26}, 21.0, 30.0, {"big": 2.0}) == []
    assert _fake_trials({"big": 3.0}, 21.0, 30.0, {"big": 2.0}) == ["big"]
    # a small node pays little; a node whose move reaches the target is kept whatever its size
    assert _fake_trials({"small": 0.3}, 21.0, 30.0, {"small": 0.05}) == ["small"]
    assert _fake_trials({"big": 1.0}, 29.5, 30.0, {"big": 2.0}) == ["big"]


def test_size_prices_are_the_share_of_the_8_bit_weights_a_float_node_adds():
    from qtool.choice.search import DB_PER_SIZE, _size_prices
    from tests.quantization.models import conv_chain

    model = conv_chain(channels=16)
    prices = _size_prices(model)
    values = {i.name: int(np.prod(i.dims)) for i in model.graph.initializer}
    total = sum(values.values())
    assert prices["conv1"] == pytest.approx(DB_PER_SIZE * 3 * values["w1"] / total)
    assert prices["relu0"] == 0.0


def _start(scores: dict[str, float], ratios: dict[str, float]) -> tuple[str, str] | None:
    """Where _search_plan starts with these scores, each candidate timed at ``ratios[name]`` x storage."""
    from qtool.choice.candidates import BuiltCandidates
    from qtool.choice.selection import _search_plan

    built = BuiltCandidates()
    for name, db in scores.items():
        built.plans[name], built.aliases[name], built.scores[name] = (None, None), [], db  # type: ignore[assignment]
    times = {name: [ratios.get(name, 1.0) * 1e-3 * (1 + 0.001 * i) for i in range(12)] for name in scores}
    candidates = [candidate(n, 1, 0, db, db >= 30.0, ratios.get(n, 1.0)) for n, db in scores.items()]
    choice = PlacementChoice(30.0, [], 1, candidates, "auto", "", fp32_ms=1.0, times=times)
    return _search_plan(choice, built, timed=True)


def test_the_search_starts_from_the_most_accurate_integer_candidate_faster_than_storage():
    scores = {"auto": 26.3, "unchained": 29.4, "storage": 34.0}
    # both decisively faster: the one nearest the target ("auto" with its chained ops float)
    assert _start(scores, {"auto": 0.7, "unchained": 0.8}) == ("unchained", "float activations")
    # "unchained" no faster than storage: refining it cannot pay; "auto" can
    assert _start(scores, {"auto": 0.7, "unchained": 0.95}) == ("auto", "float activations")
    # neither: no search (a note says why)
    assert _start(scores, {"auto": 0.95, "unchained": 0.97}) is None
    # a start that already reaches the target needs no search: the other one is refined
    assert _start({**scores, "unchained": 31.0}, {"auto": 0.7, "unchained": 0.8}) == ("auto", "float activations")
    # storage misses too: whole nodes float, from the faster integer candidate when it is the more accurate,
    # else from storage
    assert _start({**scores, "storage": 28.0}, {"auto": 0.7, "unchained": 0.8}) == ("unchained", "float")
    assert _start({**scores, "storage": 28.0}, {"auto": 0.95, "unchained": 0.97}) == ("storage", "float")
    assert _start({**scores, "storage": 29.6}, {"auto": 0.7, "unchained": 0.8}) == ("storage", "float")


def test_the_search_goes_on_until_the_bound_of_its_samples_reaches_the_target():
    from dataclasses import replace as copy

    from qtool.choice.search import FLOAT_ACTIVATIONS, _try_in_float
    from qtool.config import load_config

    config = load_config(None)
    config = copy(config, accuracy=copy(config.accuracy, target_sqnr_db=30.0, max_float_nodes=4))
    gains = {"a": 1.0, "b": 0.5, "c": 0.5}
    result = SearchResult(30.0, 4, 8, 29.0, 29.0, moves=FLOAT_ACTIVATIONS)

    class Scorer:  # the bound sits 0.6 dB under the worst output
        def score(self, model: object) -> object:
            total = 29.0 + sum(gains[n] for n in model)  # type: ignore[attr-defined]
            return type("Score", (), {"worst_db": total, "worst_bound_db": lambda self: total - 0.6})()

    def quantize(cfg: object) -> tuple[object, set[str]]:
        return set(cfg.sensitive_nodes), set()  # type: ignore[attr-defined]

    ranking = [_row(n, 0.0, 1.0, i) for i, n in enumerate(gains)]
    clock = (time.perf_counter(), lambda _: None)
    _, sqnr = _try_in_float(config, ranking, quantize, Scorer(), result, clock, ({}, Moves()))  # type: ignore[arg-type]
    # "a" reaches 30 dB, its bound 29.4 does not: "b" brings the bound to 29.9, "c" to 30.4
    assert result.kept_nodes == ["a", "b", "c"] and result.reached_at(sqnr) and sqnr == pytest.approx(31.0)
    assert result.final_bound_db == pytest.approx(30.4)


def test_the_search_tries_no_move_that_would_leave_it_no_faster_than_storage():
    from dataclasses import replace as copy

    from qtool.choice.search import FLOAT_ACTIVATIONS, _try_in_float
    from qtool.config import load_config

    config = load_config(None)
    config = copy(config, accuracy=copy(config.accuracy, target_sqnr_db=30.0, max_float_nodes=4))
    gains = {"a": 0.5, "b": 0.5, "c": 1.0}
    tried: list[str] = []

    class Scorer:
        def score(self, model: object) -> object:
            tried.append(",".join(sorted(model)))  # type: ignore[call-overload]
            total = 28.0 + sum(gains[n] for n in model)  # type: ignore[attr-defined]
            return type("Score", (), {"worst_db": total, "worst_bound_db": lambda self: total})()

    def quantize(cfg: object) -> tuple[object, set[str]]:
        return set(cfg.sensitive_nodes), set()  # type: ignore[attr-defined]

    ranking = [_row(n, 0.0, 1.0, i) for i, n in enumerate(gains)]
    moves = Moves(FLOAT_ACTIVATIONS, {"a": 0.3, "b": 0.3, "c": 0.1}, "test", budget_ms=0.5)
    result = SearchResult(30.0, 4, 8, 28.0, 28.0, moves=FLOAT_ACTIVATIONS)
    _try_in_float(config, ranking, quantize, Scorer(), result, (time.perf_counter(), lambda _: None), ({}, moves))  # type: ignore[arg-type]
    # "a" spends 0.3 of the 0.5 ms; "b" (0.3 more) is not even built; "c" (0.1) fits
    assert tried == ["a", "a,c"] and result.kept_nodes == ["a", "c"]
    assert "no faster placement left" in result.stopped and "1 node not tried" in result.stopped
    unbounded = SearchResult(30.0, 4, 8, 28.0, 28.0, moves=FLOAT_ACTIVATIONS)
    _try_in_float(
        config,
        ranking,
        quantize,
        Scorer(),
        unbounded,
        (time.perf_counter(), lambda _: None),
        ({}, copy(moves, budget_ms=None)),
    )  # type: ignore[arg-type]
    assert unbounded.kept_nodes == ["a", "b", "c"]
