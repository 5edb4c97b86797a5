"""compare on generated multi-head models: agreement only for class scores, IoU for boxes, a valid report."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.options import EvaluationOptions

runner = CliRunner()
RNG = np.random.default_rng(11)
FEATURES = 16
# Gemm heads of x and their columns; xy and wh make the corner boxes
HEADS = {"prob": 5, "quality": 3, "fc": 1000, "embedding": 64, "xy": 2, "wh": 2}


def _heads_model(path: Path, weights: dict[str, np.ndarray]) -> Path:
    """x [N, 16] -> prob (Softmax), quality [N,3], fc [N,1000] logits, embedding [N,64], corner boxes [N,4]."""
    nodes = [helper.make_node("Gemm", ["x", f"w_{h}"], [f"{h}_gemm"]) for h in HEADS]
    nodes += [
        helper.make_node("Softmax", ["prob_gemm"], ["prob"], axis=-1),
        helper.make_node("Identity", ["quality_gemm"], ["quality"]),
        helper.make_node("Identity", ["fc_gemm"], ["fc"]),
        helper.make_node("Identity", ["embedding_gemm"], ["embedding"]),
        helper.make_node("Abs", ["wh_gemm"], ["wh"]),
        helper.make_node("Add", ["xy_gemm", "wh"], ["x2y2"]),
        helper.make_node("Concat", ["xy_gemm", "x2y2"], ["boxes"], axis=1),
    ]
    outputs = ["prob", "quality", "fc", "embedding", "boxes"]
    graph = helper.make_graph(
        nodes,
        "heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["N", None]) for o in outputs],
        [numpy_helper.from_array(w, f"w_{h}") for h, w in weights.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    return path


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The float model, a candidate with 2 % weight noise, and 4 samples of 8 rows."""
    folder = tmp_path_factory.mktemp("heads")
    weights = {h: RNG.normal(size=(FEATURES, c)).astype(np.float32) for h, c in HEADS.items()}
    noisy = {h: (w * (1 + 0.02 * RNG.normal(size=w.shape))).astype(np.float32) for h, w in weights.items()}
    data = folder / "data"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", RNG.normal(size=(8, FEATURES)).astype(np.float32))
    return _heads_model(folder / "ref.onnx", weights), _heads_model(folder / "cand.onnx", noisy), data


def _compare_json(*args: object) -> dict:
    r = runner.invoke(app, ["compare", *map(str, args), "--runs", "0", "--json", "-"])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _schema() -> dict:
    r = runner.invoke(app, ["schema", "compare-report"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_agreement_only_for_class_scores_and_iou_for_boxes(heads):
    ref, cand, data = heads
    report = _compare_json(ref, cand, "--data", data)
    jsonschema.Draft202012Validator(_schema()).validate(report)
    accuracy = report["accuracy"]
    kinds = {k["output"]: (k["kind"], k["reason"]) for k in accuracy["output_kinds"]}
    assert kinds == {
        "prob": ("class_scores", "Softmax output"),
        "quality": ("values", "[N,3], named like a regression output"),
        "fc": ("class_scores", "[N,1000] logits from Gemm"),
        "embedding": ("values", "[N,64], named like a regression output"),
        "boxes": ("boxes", "[N,4] boxes, IoU"),
    }
    assert [a["output"] for a in accuracy["classification"]] == ["prob", "fc"]
    assert all(a["rows"] == 32 and 0.5 < a["top1"] <= a["top5"] for a in accuracy["classification"])
    (boxes,) = accuracy["boxes"]
    assert boxes["output"] == "boxes" and boxes["boxes"] == 32 and 0.5 < boxes["mean_iou"] < 1.0
    assert accuracy["task"].startswith("classification: 'prob' (Softmax output), 'fc' ([N,1000] logits from Gemm);")
    assert [m["name"] for m in accuracy["outputs"]] == ["prob", "quality", "fc", "embedding", "boxes"]


def test_task_classification_forces_agreement_and_none_disables_it(heads):
    ref, cand, data = heads
    forced = qtool.compare(ref, cand, data, options=EvaluationOptions(runs=0, task="classification"))
    assert [a.output for a in forced.classification] == ["prob", "quality", "fc", "embedding", "boxes"]
    assert forced.boxes == []
    off = qtool.compare(ref, cand, data, options=EvaluationOptions(runs=0, task="none"))
    assert off.classification == [] and [b.output for b in off.boxes] == ["boxes"]
    assert off.task.startswith("error metrics only: 'prob' (Softmax output; --task none)")


def _box_model(path: Path, shift: float) -> Path:
    """boxes = x + shift, for x [N, 4]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "shift"], ["boxes"])],
        "boxes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.full(4, shift, np.float32), "shift")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    return path


def test_box_iou_in_the_report_equals_the_hand_computed_value_and_gates(tmp_path):
    ref, cand = _box_model(tmp_path / "ref.onnx", 0.0), _box_model(tmp_path / "cand.onnx", 1.0)
    data = tmp_path / "data"
    data.mkdir()
    # two real boxes and an all-zero padding row, which has no IoU and is left out
    np.save(data / "0.npy", np.array([[0, 0, 2, 2], [0, 0, 4, 4], [0, 0, 0, 0]], np.float32))
    expected = (1 / 7 + 9 / 23) / 2  # [0,0,2,2] vs [1,1,3,3]: 1/(4+4-1); [0,0,4,4] vs [1,1,5,5]: 9/(16+16-9)
    report = _compare_json(ref, cand, "--data", data)
    jsonschema.Draft202012Validator(_schema()).validate(report)
    (boxes,) = report["accuracy"]["boxes"]
    assert boxes["boxes"] == 2 and boxes["mean_iou"] == pytest.approx(expected, abs=1e-6)
    assert report["accuracy"]["classification"] == []

    base = ["compare", ref, cand, "--data", data, "--runs", "0"]
    ok = runner.invoke(app, [*map(str, base), "--fail-under", "box_iou=0.26", "--markdown", str(tmp_path / "r.md")])
    assert ok.exit_code == 0, ok.stderr
    assert "boxes: mean box IoU 0.2671 over 2 boxes" in ok.stdout
    assert "`boxes`: mean box IoU 0.2671 (2 boxes)" in (tmp_path / "r.md").read_text()
    bad = runner.invoke(app, [*map(str, base), "--fail-under", "box_iou=0.27"])
    assert bad.exit_code == 1 and "gates failed" in bad.stderr
