"""The inspect pipeline: the plan quantize would follow, and the exact size it would write."""

from __future__ import annotations

import qtool
from qtool.config import load_config
from qtool.pipeline.inspect import inspect
from qtool.pipeline.workspace import open_workspace
from tests.conftest import calib_dir, sample


def test_the_predicted_size_is_what_quantize_writes_for_the_same_plan(tmp_path):
    config = {"global": {"placement": "integer"}}
    ws = open_workspace(sample("cnn"), load_config(config))
    result = inspect(ws, calib_dir("cnn"))
    out = tmp_path / "q.onnx"
    qtool.quantize(sample("cnn"), out, config_path=config, data_dir=calib_dir("cnn"), search=None, evaluation=None)
    assert {row.placement for row in result.rows} == {"integer", "chained"}  # the pools between the Convs chained
    assert abs(result.predicted_bytes - out.stat().st_size) <= 64  # only the scale values differ


def test_without_data_static_shapes_decide_and_every_weighted_node_is_listed():
    ws = open_workspace(sample("mlp"), load_config())
    result = inspect(ws, None)
    assert [row.name for row in result.rows] == ["fc0/matmul", "fc1/matmul", "fc2/matmul"]
    assert result.predicted_ratio > 1
