"""How compare judges an output (class scores, boxes, values) from its source op, name and values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.evaluation.metrics import box_iou
from qtool.evaluation.output_kinds import OutputSource, decide_kind, output_sources, task_note

RNG = np.random.default_rng(3)


def kind(name, op, value, task="auto"):
    return decide_kind(OutputSource(name, op), np.asarray(value, np.float32), task)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


LOGITS = RNG.normal(size=(8, 1000))
CORNERS = np.concatenate([xy := RNG.uniform(0, 100, (8, 2)), xy + RNG.uniform(1, 50, (8, 2))], axis=1)


@pytest.mark.parametrize(
    ("name", "op", "value", "expected", "reason"),
    [
        ("out", "Softmax", softmax(RNG.normal(size=(8, 3))), "class_scores", "Softmax output"),
        ("out", "LogSoftmax", np.log(softmax(RNG.normal(size=(8, 5)))), "class_scores", "LogSoftmax output"),
        ("attn", "Softmax", softmax(RNG.normal(size=(8, 3, 6)), axis=1), "values", "Softmax over another axis"),
        ("out", None, softmax(RNG.normal(size=(8, 3))), "class_scores", "rows are probabilities"),
        ("fc", "Gemm", LOGITS, "class_scores", "[N,1000] logits from Gemm"),
        ("fc", "Gemm", LOGITS[:, :10], "class_scores", "[N,10] logits from Gemm"),
        ("fc", "Gemm", LOGITS[:, :9], "values", "[N,9], not class scores"),
        ("quality", "Gemm", LOGITS[:, :3], "values", "[N,3], named like a regression output"),
        ("fc1_embedding", "Gemm", LOGITS[:, :512], "values", "named like a regression output"),
        ("seg", "Conv", RNG.normal(size=(2, 21, 16, 16)), "values", "[N,21,16,16], not class scores"),
        ("cls_score", "Add", LOGITS[:, :3], "class_scores", "[N,3], named like class scores"),
        ("qualityScore", "Add", LOGITS[:, :3], "values", "named like a regression output"),
        ("logits", "Add", LOGITS.reshape(2, 4, 1000), "class_scores", "[N,4,1000], named like class scores"),
        ("boxes", "Concat", CORNERS, "boxes", "[N,4] boxes, IoU"),
        ("pred_bbox", "Gemm", np.zeros((8, 4)), "boxes", "[N,4] boxes, IoU"),  # zero padding is still corners
        ("loc", "Conv", LOGITS[:, :4], "values", "[N,4] named like boxes but not (x1, y1, x2, y2) corners"),
        ("score", "Gemm", LOGITS[:, :1], "values", "[N,1], one value per row"),
        ("y", None, np.float32(2.0), "values", "scalar, one value per row"),
    ],
)
def test_auto_rules(name, op, value, expected, reason):
    decided = kind(name, op, value)
    assert decided.kind == expected, decided.reason
    assert reason in decided.reason


def test_task_classification_forces_and_task_none_disables():
    forced = kind("quality", "Gemm", LOGITS[:, :3], task="classification")
    assert (forced.kind, forced.reason) == ("class_scores", "--task classification")
    assert kind("y", "Gemm", LOGITS[:, :1], task="classification").kind == "values"  # one column: no argmax
    off = kind("prob", "Softmax", softmax(LOGITS), task="none")
    assert (off.kind, off.reason) == ("values", "Softmax output; --task none")
    assert kind("boxes", "Concat", CORNERS, task="none").kind == "boxes"  # IoU is an error metric


def test_task_note_says_how_each_output_was_judged():
    kinds = [
        kind("prob", "Softmax", softmax(LOGITS[:, :5])),
        kind("boxes", "Concat", CORNERS),
        kind("quality", "Gemm", LOGITS[:, :3] * 10),
    ]
    assert task_note(kinds) == (
        "classification: 'prob' (Softmax output); error metrics only: 'boxes' ([N,4] boxes, IoU), "
        "'quality' ([N,3], named like a regression output)"
    )
    assert task_note([]) == "no float output compared"


def _model(nodes, outputs, inits):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 2, 2])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph)


def test_output_sources_look_through_reshapes_pooling_and_a_constant_bias_but_not_a_residual():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"]),
        helper.make_node("Flatten", ["p"], ["conv_head"]),
        helper.make_node("Flatten", ["x"], ["f"]),
        helper.make_node("MatMul", ["f", "m"], ["mm"]),
        helper.make_node("Add", ["bias", "mm"], ["mm_bias"]),
        helper.make_node("Identity", ["mm_bias"], ["matmul_head"]),
        helper.make_node("Add", ["mm", "f2"], ["residual"]),
        helper.make_node("MatMul", ["f", "m"], ["f2"]),
        helper.make_node("Transpose", ["x"], ["passed"]),
    ]
    inits = {"w": np.zeros((12, 8, 1, 1)), "m": np.zeros((32, 12)), "bias": np.zeros(12)}
    sources = output_sources(_model(nodes, ["conv_head", "matmul_head", "residual", "passed"], inits))
    assert {name: s.op_type for name, s in sources.items()} == {
        "conv_head": "Conv",
        "matmul_head": "MatMul",
        "residual": "Add",
        "passed": None,  # a graph input
    }


def test_box_iou_matches_a_hand_computed_value():
    ref = np.array([[0, 0, 2, 2], [0, 0, 4, 4], [0, 0, 1, 1]], np.float32)
    cand = np.array([[1, 1, 3, 3], [1, 1, 5, 5], [1, 1, 0.5, 0.5]], np.float32)  # the last turned inside out
    # [0,0,2,2] vs [1,1,3,3]: 1 / (4 + 4 - 1); [0,0,4,4] vs [1,1,5,5]: 9 / (16 + 16 - 9)
    np.testing.assert_allclose(box_iou(ref, cand), [1 / 7, 9 / 23, 0.0])
    assert box_iou(ref, ref).tolist() == [1.0, 1.0, 1.0]
