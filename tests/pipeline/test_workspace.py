"""The workspace: one plan per distinct (model revision, config, sizes), reused by every stage."""

from __future__ import annotations

from dataclasses import replace

import onnx
import pytest

from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.options import DEFAULT_CALIBRATION, DEFAULT_OUTPUT, DEFAULT_SEARCH, SearchOptions
from qtool.pipeline.quantize import QuantizeRequest, quantize
from qtool.pipeline.workspace import Transforms, open_workspace
from tests.conftest import calib_dir, sample


def _request(tmp_path, name: str, search: SearchOptions | None) -> QuantizeRequest:
    return QuantizeRequest(
        output_path=tmp_path / "q.onnx",
        stats_path=None,
        data_dir=calib_dir(name),
        calibration=DEFAULT_CALIBRATION,
        search=search,
        evaluation=None,
        eval_dir=None,
        output=DEFAULT_OUTPUT,
    )


def test_a_plan_is_built_once_and_handed_out_again():
    ws = open_workspace(sample("cnn"), load_config())
    first = ws.plan()
    assert ws.plan() is first and ws.plan(load_config()) is first  # an equal config is the same plan
    sized = ws.plan(elements=ws.sizes())
    assert sized is not first and ws.plan(elements=ws.sizes()) is sized
    assert ws.plans_built == 2


def test_quantize_without_search_builds_two_plans_one_unsized_for_calibration_one_sized_for_the_build(tmp_path):
    ws = open_workspace(sample("mlp"), load_config())
    result = quantize(ws, _request(tmp_path, "mlp", None), None)
    assert ws.plans_built == 2
    assert result.placements  # the model was written from the sized plan
    assert onnx.load(str(tmp_path / "q.onnx")).graph.node


def test_the_placement_choice_builds_one_plan_per_distinct_candidate_and_the_winner_is_not_planned_again(tmp_path):
    ws = open_workspace(sample("cnn"), load_config())
    result = quantize(ws, _request(tmp_path, "cnn", replace(DEFAULT_SEARCH, latency_runs=0)), None)
    choice = result.placement_choice
    assert choice is not None
    # one unsized plan for calibration, one per candidate config (aliases included: each is a config
    # whose plan turned out the same), one per node the search tried; the winner is planned no more, but for its
    # weights' rounding: the config with GPTQ, unsized for the pass that reads its inputs and sized for the build
    configs = sum(1 + len(c.same_as) for c in choice.candidates if c.name != "search")
    tried = len(choice.search.steps) if choice.search is not None else 0
    rounded = 2 if "rounded by GPTQ" in choice.rounding_note else 0
    assert ws.plans_built == 1 + configs + tried + rounded


def test_a_pass_that_rewrites_the_model_starts_a_new_revision():
    ws = open_workspace(sample("cnn"), load_config())
    before = ws.plan()
    copy = onnx.ModelProto()
    copy.CopyFrom(ws.prepared)
    ws.transformed(copy, Transforms(equalized=("a -> b",)))
    assert ws.plan() is not before and ws.transforms.equalized == ("a -> b",)
    ws.transformed(ws.prepared, ws.transforms)  # the same model: no new revision
    assert ws.plans_built == 2


def test_a_node_name_rule_that_matches_nothing_is_refused_with_the_closest_names(tmp_path):
    config = load_config({"node_name": {"block0/conw": {"placement": "storage"}}})
    with pytest.raises(QtoolError, match="block0/conw") as e:
        open_workspace(sample("cnn"), config)
    assert "block0/conv" in (e.value.hint or "")
