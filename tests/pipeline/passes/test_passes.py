"""The pre-calibration passes read the plan: only the nodes it marks are rewritten, and each says what it did."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.options import DEFAULT_CALIBRATION, CalibrationOptions
from qtool.pipeline.passes import (
    BEFORE_CALIBRATION,
    BEFORE_QUANTIZATION,
    Awq,
    Equalize,
    PassInputs,
    SmoothQuant,
    check_passes,
    run_passes,
)
from qtool.pipeline.passes.awq import NO_DATA
from qtool.pipeline.workspace import open_workspace
from tests.conftest import calib_dir, run_model, sample

INTEGER = {"global": {"placement": "integer"}}
AWQ_INT4 = {
    "global": {
        "weight": {"dtype": "int4", "granularity": "per_block"},
        "weight_only": True,
        "algorithms": {"awq": True},
    }
}


def _same_outputs(ws, model: onnx.ModelProto) -> bool:
    """Whether the rewritten float model computes what the original computes, on a calibration sample."""
    x = np.load(sorted(calib_dir(ws.path.parent.name).iterdir())[0])
    name = ws.model.graph.input[0].name
    x = x if x.ndim == len(ws.model.graph.input[0].type.tensor_type.shape.dim) else x[None]
    original = run_model(ws.path.read_bytes(), {name: x})[0]
    rewritten = run_model(ws.weights.embedded(model).SerializeToString(), {name: x})[0]
    return bool(np.allclose(rewritten, original, rtol=1e-4, atol=1e-4))


def test_equalization_rescales_only_the_conv_pairs_whose_nodes_the_plan_marks():
    marked = {
        **INTEGER,
        "node_name": {n: {"algorithms": {"equalization": True}} for n in ("block0/conv", "block1/conv")},
    }
    ws = open_workspace(sample("cnn"), load_config(marked))
    before = ws.prepared
    run_passes(ws, (Equalize(),), PassInputs(None, DEFAULT_CALIBRATION))
    assert ws.transforms.equalized == ("block0/conv -> block1/conv",)
    assert ws.prepared is not before


def test_equalization_leaves_the_model_alone_when_no_node_asks_for_it():
    ws = open_workspace(sample("cnn"), load_config(INTEGER))
    before = ws.prepared
    run_passes(ws, (Equalize(),), PassInputs(None, DEFAULT_CALIBRATION))
    assert ws.prepared is before and ws.transforms.equalized == () and ws.plans_built == 1


def test_smoothquant_measures_the_channel_ranges_of_the_planned_inputs_and_keeps_the_outputs():
    config = load_config({**INTEGER, "global": {"placement": "integer", "algorithms": {"smoothquant": True}}})
    ws = open_workspace(sample("mlp"), config)
    run_passes(ws, (SmoothQuant(),), PassInputs(calib_dir("mlp"), DEFAULT_CALIBRATION))
    inputs = {n.input[0] for n in ws.model.graph.node if n.op_type == "MatMul"}
    assert set(ws.transforms.smoothing) == inputs  # one channel range per MatMul input, from the float pass
    dims = {i.name: list(i.dims) for i in ws.model.graph.initializer}
    for node in (n for n in ws.model.graph.node if n.op_type == "MatMul"):
        assert ws.transforms.smoothing[node.input[0]].shape == (dims[node.input[1]][0],)  # K channels
    assert _same_outputs(ws, ws.prepared)


def test_awq_without_samples_scales_nothing_and_says_why_per_node():
    config = load_config(AWQ_INT4)
    ws = open_workspace(sample("mlp"), config)
    before = ws.prepared
    run_passes(ws, (Awq(),), PassInputs(None, DEFAULT_CALIBRATION))
    assert ws.prepared is before
    readers = [n.name for n in ws.plan().nodes if n.op_type == "MatMul" and n.placement == "weight_only"]
    assert readers and all(ws.transforms.awq_notes[name] == NO_DATA for name in readers)


def test_awq_with_samples_moves_scales_into_the_weights():
    config = load_config(AWQ_INT4)
    ws = open_workspace(sample("mlp"), config)
    before = ws.prepared
    readers = [n.name for n in ws.plan().nodes if n.op_type == "MatMul"]
    run_passes(ws, (Awq(),), PassInputs(calib_dir("mlp"), DEFAULT_CALIBRATION))
    scaled = {node for group in ws.transforms.awq for node in group.nodes}
    assert scaled and scaled <= set(readers)
    assert ws.prepared is not before and _same_outputs(ws, ws.prepared)  # scales moved, the function kept


def test_every_pass_checks_its_preconditions_before_any_pass_runs():
    applied = []

    class Recording(Equalize):
        def apply(self, workspace, inputs):  # type: ignore[no-untyped-def]
            applied.append(self.name)
            return super().apply(workspace, inputs)

    config = load_config({"global": {"placement": "integer", "algorithms": {"smoothquant": True}}})
    ws = open_workspace(sample("mlp"), config)
    before = ws.prepared
    with pytest.raises(QtoolError, match="smoothquant needs calibration samples"):
        run_passes(ws, (Recording(), SmoothQuant()), PassInputs(None, DEFAULT_CALIBRATION))
    assert applied == [] and ws.prepared is before  # refused before the first pass ran


@pytest.mark.parametrize(
    ("options", "without"),
    [(CalibrationOptions(shard=(1, 2)), "--shard"), (CalibrationOptions(workers=2, shard=(1, 2)), "--workers")],
)
def test_calibrates_smoothquant_refuses_part_of_the_data_set_and_quantizes_does_not(options, without):
    config = load_config({"global": {"placement": "integer", "algorithms": {"smoothquant": True}}})
    ws = open_workspace(sample("mlp"), config)
    inputs = PassInputs(calib_dir("mlp"), options)
    with pytest.raises(QtoolError, match=f"whole data set before calibrating: calibrate without {without}"):
        check_passes(ws, BEFORE_CALIBRATION, inputs)
    check_passes(ws, BEFORE_QUANTIZATION, inputs)  # quantize smooths with the ranges of its own float pass
