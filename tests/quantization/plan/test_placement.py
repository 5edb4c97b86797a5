"""Placement "auto": integer kernels where a node does enough work per value, storage elsewhere."""

from __future__ import annotations

from qtool.config import load_config
from qtool.quantization.plan.placement import AUTO_MIN_MACS
from qtool.quantization.plan.planner import build_plan
from qtool.quantization.plan.roles import static_elements
from tests.quantization.models import conv_chain, prepared


def _placements(model, config=None, elements=True):
    plan = build_plan(model, load_config(config), static_elements(model) if elements else None)
    return {n.name: (n.placement, n.reason) for n in plan.nodes}


def test_without_sizes_every_auto_node_is_planned_integer():
    model, _ = prepared(conv_chain())
    assert {p for p, _ in _placements(model, elements=False).values()} == {"integer"}


def test_small_convolutions_are_stored_and_large_ones_run_integer():
    small, _ = prepared(conv_chain(channels=4, size=8))
    assert all(p == "storage" and f"< {AUTO_MIN_MACS:,}" in why for p, why in _placements(small).values())
    large, _ = prepared(conv_chain(channels=32, size=64))
    placed = _placements(large)
    assert placed["conv1"][0] == "integer" and "MACs per sample" in placed["conv1"][1]


def test_a_depthwise_convolution_is_stored():
    model, _ = prepared(conv_chain(channels=32, size=64, depthwise_middle=True))
    placement, why = _placements(model)["conv1"]
    assert placement == "storage" and "depthwise" in why


def test_an_explicit_placement_is_the_users():
    model, _ = prepared(conv_chain(channels=4, size=8))
    placed = _placements(model, {"node_name": {"conv1": {"placement": "integer"}}})
    assert placed["conv1"] == ("integer", "placement: integer (node_name:conv1)")
