"""Outputs that concatenate boxes and class scores: each part measured on its own, run by onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from qtool.calibration.dataset import Dataset, model_inputs
from qtool.cli import app
from qtool.evaluation.output_parts import concat_layouts, scaled_parts
from qtool.evaluation.scoring import OutputScorer
from tests.conftest import run_model

runner = CliRunner()
ANCHORS = 50


def _detector(score_noise: float = 0.0, *, nested: bool = False, transposed: bool = False) -> onnx.ModelProto:
    """A detector's end: boxes in pixels (x 200) and sigmoid class scores, concatenated along the channels.

    ``score_noise``: a constant added to the scores' logits (a candidate whose scores are off, boxes exact).
    ``nested``: two scales, each joining boxes and scores, reshaped and joined along the anchors (YOLO-style).
    ``transposed``: the output is [N, anchors, 4 + classes].
    """
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 8, 1, 1)).astype(np.float32), "wb"),
        numpy_helper.from_array(rng.standard_normal((3, 8, 1, 1)).astype(np.float32), "wc"),
        numpy_helper.from_array(np.array([200.0], np.float32), "pixels"),
        numpy_helper.from_array(np.array([score_noise], np.float32), "shift"),
        numpy_helper.from_array(np.array([1, 0, -1], np.int64), "flat"),
    ]
    end = "joined" if transposed else "detections"
    nodes, joined = [], []
    for s in range(2 if nested else 1):
        nodes += [
            helper.make_node("Conv", ["x", "wb"], [f"b{s}"]),
            helper.make_node("Mul", [f"b{s}", "pixels"], [f"box{s}"]),
            helper.make_node("Conv", ["x", "wc"], [f"c{s}"]),
            helper.make_node("Add", [f"c{s}", "shift"], [f"cs{s}"]),
            helper.make_node("Sigmoid", [f"cs{s}"], [f"score{s}"]),
        ]
        if nested:  # each scale joins its boxes and scores, then the scales are joined along the anchors
            nodes += [
                helper.make_node("Concat", [f"box{s}", f"score{s}"], [f"cat{s}"], axis=1),
                helper.make_node("Reshape", [f"cat{s}", "flat"], [f"r{s}"]),
            ]
            joined.append(f"r{s}")
        else:
            nodes += [
                helper.make_node("Reshape", [f"box{s}", "flat"], ["rb"]),
                helper.make_node("Reshape", [f"score{s}", "flat"], ["rs"]),
            ]
            joined = ["rb", "rs"]
    nodes.append(helper.make_node("Concat", joined, [end], axis=2 if nested else 1))
    if transposed:
        nodes.append(helper.make_node("Transpose", [end], ["detections"], perm=[0, 2, 1]))
    return _model(nodes, inits, "detector")


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], name: str) -> onnx.ModelProto:
    """A graph from an input ``x`` [1, 8, 5, 10] to one output ``detections``."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 5, 10])],
        [helper.make_tensor_value_info("detections", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 8, 5, 10)).astype(np.float32))
    return data


def _parts(model: onnx.ModelProto, x: np.ndarray) -> list[str]:
    value = run_model(model.SerializeToString(), {"x": x})[0]
    return [p.name for p in scaled_parts(concat_layouts(model), {"detections": value})]


def test_boxes_and_scores_are_found_directly_nested_and_through_a_transpose():
    x = np.random.default_rng(2).standard_normal((1, 8, 5, 10)).astype(np.float32)
    assert _parts(_detector(), x) == ["detections[:, 0:4]", "detections[:, 4:7]"]
    assert _parts(_detector(nested=True), x) == ["detections[:, 0:4]", "detections[:, 4:7]"]
    assert _parts(_detector(nested=True, transposed=True), x) == ["detections[:, :, 0:4]", "detections[:, :, 4:7]"]


def test_parts_of_one_scale_stay_pooled():
    model = _detector()
    for init in model.graph.initializer:
        if init.name == "pixels":
            init.CopyFrom(numpy_helper.from_array(np.array([0.5], np.float32), "pixels"))
    x = np.random.default_rng(2).standard_normal((1, 8, 5, 10)).astype(np.float32)
    assert _parts(model, x) == []


def test_wrong_scores_under_exact_boxes_decide_the_worst_output(tmp_path):
    data = _data(tmp_path)
    reference, candidate = _detector(nested=True), _detector(0.5, nested=True)
    score = OutputScorer(reference, Dataset(data, model_inputs(reference))).score(candidate)
    pooled, boxes, scores = (score.outputs[n] for n in ("detections", "detections[:, 0:4]", "detections[:, 4:7]"))
    assert boxes == float("inf") and scores < 25.0 < pooled  # pooled, the boxes' pixels hide the scores' error
    assert score.worst_db == scores
    # a target that judges the output judges its parts; state left out is left out with its parts
    judged = OutputScorer(reference, Dataset(data, model_inputs(reference)), judged=frozenset({"detections"}))
    assert judged.score(candidate).worst_db == scores


def test_compare_lists_each_part_after_its_output_and_pools_the_whole_once(tmp_path):
    data = _data(tmp_path)
    reference, candidate = tmp_path / "ref.onnx", tmp_path / "cand.onnx"
    onnx.save(_detector(nested=True), reference)
    onnx.save(_detector(0.5, nested=True), candidate)
    report = tmp_path / "r.json"
    args = ["compare", str(reference), str(candidate), "--data", str(data), "--runs", "0", "--json", str(report)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    accuracy = json.loads(report.read_text())["accuracy"]
    names = [o["name"] for o in accuracy["outputs"]]
    assert names == ["detections", "detections[:, 0:4]", "detections[:, 4:7]"]
    by_name = {o["name"]: o for o in accuracy["outputs"]}
    assert by_name["detections[:, 4:7]"]["sqnr_db"] < 25.0 < by_name["detections"]["sqnr_db"]
    assert accuracy["overall"]["sqnr_db"] == by_name["detections"]["sqnr_db"]  # the parts are not pooled again
    assert "detections[:, 4:7]" in r.output
    note = json.loads(report.read_text())["accuracy"]["judged_note"]
    assert "part by part too: 'detections[:, 0:4]', 'detections[:, 4:7]'" in note, note


def test_a_cache_joining_its_past_input_is_not_split():
    # a decoder's present key: the past (a graph input) joined to the new along the sequence; no parts, no inference
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "x"], ["new"]),
            helper.make_node("Concat", ["past", "new"], ["present"], axis=1),
        ],
        "cache",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4]),
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 3, 4]),
        ],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, 4, 4])],
    )
    assert concat_layouts(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])) == {}


def test_an_sqnr_gate_judges_the_worst_part_not_the_pooled_output(tmp_path):
    data = _data(tmp_path)
    reference, candidate = tmp_path / "ref.onnx", tmp_path / "cand.onnx"
    onnx.save(_detector(), reference)
    onnx.save(_detector(0.5), candidate)
    report = tmp_path / "r.json"
    args = ["compare", str(reference), str(candidate), "--data", str(data), "--runs", "0", "--json", str(report)]
    r = runner.invoke(app, [*args, "--fail-under", "sqnr=25"])
    document = json.loads(report.read_text())
    scores = next(o for o in document["accuracy"]["outputs"] if o["name"] == "detections[:, 4:7]")["sqnr_db"]
    assert document["accuracy"]["overall"]["sqnr_db"] > 25 > scores  # pooled it would pass
    gate = document["gates"]["results"][0]
    assert r.exit_code == 1 and gate["passed"] is False and gate["measured"] == scores
    assert runner.invoke(app, [*args, "--fail-under", f"sqnr={scores - 1}"]).exit_code == 0


def _yolov5_style() -> onnx.ModelProto:
    """Per scale, boxes and scores joined along the last axis of [N, 3, H, W, 4 + 3], flattened to [N, -1, 7]."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((12, 8, 1, 1)).astype(np.float32), "wb"),
        numpy_helper.from_array(rng.standard_normal((9, 8, 1, 1)).astype(np.float32), "wc"),
        numpy_helper.from_array(np.array([200.0], np.float32), "pixels"),
        numpy_helper.from_array(np.array([1, 3, 4, 5, 10], np.int64), "split_boxes"),
        numpy_helper.from_array(np.array([1, 3, 3, 5, 10], np.int64), "split_scores"),
        numpy_helper.from_array(np.array([1, -1, 7], np.int64), "rows"),
    ]
    nodes, scales = [], []
    for s in range(2):
        nodes += [
            helper.make_node("Conv", ["x", "wb"], [f"b{s}"]),
            helper.make_node("Reshape", [f"b{s}", "split_boxes"], [f"b5{s}"]),
            helper.make_node("Transpose", [f"b5{s}"], [f"bt{s}"], perm=[0, 1, 3, 4, 2]),
            helper.make_node("Mul", [f"bt{s}", "pixels"], [f"box{s}"]),
            helper.make_node("Conv", ["x", "wc"], [f"c{s}"]),
            helper.make_node("Reshape", [f"c{s}", "split_scores"], [f"c5{s}"]),
            helper.make_node("Transpose", [f"c5{s}"], [f"ct{s}"], perm=[0, 1, 3, 4, 2]),
            helper.make_node("Sigmoid", [f"ct{s}"], [f"score{s}"]),
            helper.make_node("Concat", [f"box{s}", f"score{s}"], [f"cat{s}"], axis=-1),
            helper.make_node("Reshape", [f"cat{s}", "rows"], [f"r{s}"]),
        ]
        scales.append(f"r{s}")
    nodes.append(helper.make_node("Concat", scales, ["detections"], axis=1))
    return _model(nodes, inits, "yolov5")


def test_parts_joined_along_the_last_axis_of_each_scale_are_found():
    x = np.random.default_rng(2).standard_normal((1, 8, 5, 10)).astype(np.float32)
    assert _parts(_yolov5_style(), x) == ["detections[:, :, 0:4]", "detections[:, :, 4:7]"]
