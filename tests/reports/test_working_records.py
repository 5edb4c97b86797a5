"""The search's, the placement choice's and tune's working records are read by their reports in one call."""

from __future__ import annotations

import math

from qtool.choice.records import PlacementChoice, PlacementRound
from qtool.choice.search import FLOAT, FLOAT_ACTIVATIONS, SearchResult
from qtool.choice.tune.loop import Trial, marked
from qtool.choice.validated import Validation
from qtool.schemas import reports as doc
from qtool.schemas import tune
from qtool.schemas.reports.quantize import SearchStep
from tests.choice.records import candidate


def _search(moves: str) -> SearchResult:
    steps = [
        SearchStep(node="a", op_type="Conv", drop_db=3.0, sqnr_db=29.0, kept=True),
        SearchStep(node="b", op_type="Add", drop_db=None, sqnr_db=28.0, kept=False),
    ]
    return SearchResult(30.0, 4, 8, -math.inf, 29.0, steps, ranked_on_samples=16, moves=moves)  # type: ignore[arg-type]


def test_the_search_report_names_the_kept_nodes_by_how_they_moved():
    activations = doc.SearchReport.model_validate(_search(FLOAT_ACTIVATIONS), from_attributes=True).model_dump()
    assert activations["float_activation_nodes"] == ["a"] and activations["float_nodes"] == []
    assert activations["max_float_nodes"] == 4 and activations["ranked_on_samples"] == 16
    assert activations["initial_sqnr_db"] is None and not activations["reached"]  # not finite: null
    whole = doc.SearchReport.model_validate(_search(FLOAT), from_attributes=True).model_dump()
    assert whole["float_nodes"] == ["a"] and whole["float_activation_nodes"] == []


def test_the_placement_choice_report_is_read_from_the_settled_choice():
    candidates = [candidate("auto", 3, 1, 31.0, True, 2.0), candidate("storage", 0, 4, 40.0, True, 4.0)]
    choice = PlacementChoice(30.0, ["a.npy"], 1, candidates, "auto", "", fp32_ms=4.0)
    choice.validations = [PlacementRound("auto", Validation(["b.npy"], 31.5, 30.25, meets=True))]
    choice.range_worst_db = {"observer": 31.23456, "extremes": math.inf}
    choice.settle()
    report = doc.PlacementChoiceReport.model_validate(choice, from_attributes=True).model_dump()
    assert [(c["name"], c["speedup"], c["chosen"]) for c in report["candidates"]] == [
        ("auto", 2.0, True),
        ("storage", 1.0, False),
    ]
    assert report["validations"] == [
        {"candidate": "auto", "samples": ["b.npy"], "sqnr_db": 31.5, "bound_db": 30.25, "meets_target": True}
    ]
    assert report["range_scores"] == {"observer": 31.235}  # rounded; not finite: left out
    assert report["expects_speedup"] and choice.range_worst_db["extremes"] == math.inf  # the measure is kept


def test_a_trial_is_read_by_its_report_and_marked_when_tune_chooses():
    small = Trial({"z": "w4", "a": "w8"}, 31.0, 100, 4.0, 30.5, latency_ratio_interval=(0.5, 0.7))
    large = Trial({"z": "w8", "a": "w8"}, 40.0, 200, 2.0, 39.0)
    worse = Trial({"z": "w8", "a": "float"}, 35.0, 300, 1.0, 35.0)
    trials, chosen = marked([small, large, worse], large)
    assert chosen is trials[1] and [(t.chosen, t.pareto) for t in trials] == [
        (False, True),
        (True, True),
        (False, False),
    ]
    report = tune.TuneTrial.model_validate(trials[0], from_attributes=True).model_dump()
    assert list(report["allocation"]) == ["a", "z"] and report["precisions"] == {"w4": 1, "w8": 1}
    assert report["latency_ratio_interval"] == [0.5, 0.7] and report["compression_ratio"] == 4.0
    assert report["predicted_sqnr_db"] == 31.0 and report["bound_db"] is None  # NaN (not bounded): null
