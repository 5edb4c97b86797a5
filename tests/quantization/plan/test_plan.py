"""The plan: what each node, weight and activation becomes, decided from the model and the config."""

from __future__ import annotations

import pytest

from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.graph.index import GraphView
from qtool.quantization.plan.planner import build_plan, final_weighted_nodes
from qtool.quantization.plan.roles import static_elements
from tests.quantization.models import conv_chain, prepared


def test_every_conv_is_planned_with_per_channel_weights_and_its_input_and_bias():
    model, _ = prepared(conv_chain())
    plan = build_plan(model, load_config({"global": {"placement": "integer"}}))
    assert [n.name for n in plan.nodes] == ["conv0", "conv1", "conv2"]
    first = plan.nodes[0]
    assert first.placement == "integer" and first.activations == ("x",) and first.bias == "b0"
    assert first.weight is not None and first.weight.axis == 0 and first.weight.block_size is None
    assert next(iter(plan.activations)) == "x"


def test_a_null_rule_and_exclude_keep_nodes_float_with_the_rule_named():
    model, _ = prepared(conv_chain())
    config = load_config({"node_name": {"conv1": None}, "exclude": ["conv2"]})
    plan = build_plan(model, config)
    assert [n.name for n in plan.nodes] == ["conv0"]
    assert dict(plan.skipped) == {"conv1": "kept in float by the config", "conv2": "kept in float by the config"}


def test_per_block_weights_run_weight_only_along_the_reduction_axis():
    model, _ = prepared(conv_chain())
    config = load_config({"global": {"weight": {"dtype": "int4", "granularity": "per_block", "block_size": 16}}})
    plan = build_plan(model, config, static_elements(model))
    conv1 = next(n for n in plan.nodes if n.name == "conv1")
    assert conv1.placement == "weight_only" and conv1.activations == ()
    assert conv1.weight is not None and conv1.weight.axis == 1 and conv1.weight.block_size == 16


def test_the_final_projection_keeps_int8_when_the_rest_is_int4_weight_only():
    model, _ = prepared(conv_chain())
    config = load_config({"global": {"weight": {"dtype": "int4", "granularity": "per_channel"}, "weight_only": True}})
    plan = build_plan(model, config)
    dtypes = {n.name: n.scheme.weight.dtype for n in plan.nodes}
    assert dtypes == {"conv0": "int4", "conv1": "int4", "conv2": "int8"}
    assert final_weighted_nodes(model, GraphView(model)) == {"conv2"}


def test_an_axis_out_of_range_is_refused_naming_the_node_and_rule():
    model, _ = prepared(conv_chain())
    config = load_config({"node_name": {"conv0": {"weight": {"axis": 7}}}})
    with pytest.raises(QtoolError, match=r"conv0.*axis 7") as e:
        build_plan(model, config)
    assert "node_name:conv0" in (e.value.hint or "")


def test_mode_dynamic_on_a_conv_is_planned_static():
    model, _ = prepared(conv_chain())
    plan = build_plan(model, load_config({"global": {"mode": "dynamic", "placement": "integer"}}))
    assert {n.placement for n in plan.nodes} == {"integer"}  # ConvInteger is slower than QLinearConv
