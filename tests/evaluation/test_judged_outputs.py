"""Which outputs an accuracy target judges (issue 46): named ones, or every output but the state fed back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from qtool.cli import app
from qtool.errors import QtoolError
from qtool.evaluation.judged import judged_outputs

runner = CliRunner()


def _streaming(state_in: str = "state", state_out: str = "stateN", extra: bool = False) -> onnx.ModelProto:
    """A chunk and a recurrent state in; a probability and the next state out (a voice-activity detector's shape)."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array((rng.standard_normal((64, 32)) * 0.3).astype(np.float32), "w_in"),
        numpy_helper.from_array((rng.standard_normal((32, 32)) * 0.3).astype(np.float32), "w_state"),
        numpy_helper.from_array((rng.standard_normal((32, 1)) * 0.3).astype(np.float32), "w_out"),
    ]
    nodes = [
        helper.make_node("MatMul", ["chunk", "w_in"], ["a"], name="in_proj"),
        helper.make_node("MatMul", [state_in, "w_state"], ["b"], name="state_proj"),
        helper.make_node("Add", ["a", "b"], ["pre"], name="add"),
        helper.make_node("Tanh", ["pre"], [state_out], name="tanh"),
        helper.make_node("MatMul", [state_out, "w_out"], ["logit"], name="out_proj"),
        helper.make_node("Sigmoid", ["logit"], ["prob"], name="sigmoid"),
    ]
    outputs = [
        helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 1]),
        helper.make_tensor_value_info(state_out, TensorProto.FLOAT, [1, 32]),
    ]
    if extra:
        outputs.append(helper.make_tensor_value_info("logit", TensorProto.FLOAT, [1, 1]))
    graph = helper.make_graph(
        nodes,
        "streaming",
        [
            helper.make_tensor_value_info("chunk", TensorProto.FLOAT, [1, 64]),
            helper.make_tensor_value_info(state_in, TensorProto.FLOAT, [1, 32]),
        ],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("state_in", "state_out"), [("state", "stateN"), ("h0", "hn"), ("hidden_in", "hidden_out")])
def test_a_state_output_pairs_with_its_input_and_is_not_judged(state_in: str, state_out: str) -> None:
    judged = judged_outputs(_streaming(state_in, state_out))
    assert judged.judged == ("prob",) and judged.state == {state_out: state_in} and judged.subset == {"prob"}
    assert state_out in judged.note() and "not judged" in judged.note()


def test_named_outputs_are_judged_and_a_pattern_naming_none_is_an_error() -> None:
    model = _streaming(extra=True)
    assert judged_outputs(model, ["re:(prob|logit)"]).judged == ("prob", "logit")
    assert judged_outputs(model, ["stateN"]).subset == {"stateN"}
    with pytest.raises(QtoolError, match="'probability' names no output"):
        judged_outputs(model, ["probability"])


def test_outputs_of_another_shape_are_not_state() -> None:
    model = _streaming()
    model.graph.output[1].type.tensor_type.shape.dim[1].dim_value = 16  # stateN no longer fits state
    assert judged_outputs(model).subset is None and judged_outputs(model).note() == ""


def _saved_with_data(folder: Path, seed: int) -> tuple[Path, Path]:
    """The streaming model saved in ``folder``, and 16 samples of a chunk and a state beside it."""
    model_path, data = folder / "stream.onnx", folder / "data"
    onnx.save(_streaming(), model_path)
    data.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(16):
        chunk = rng.standard_normal((1, 64)).astype(np.float32)
        np.savez(data / f"{i:02d}.npz", chunk=chunk, state=np.tanh(rng.standard_normal((1, 32))).astype(np.float32))
    return model_path, data


def test_quantize_says_which_outputs_it_judged(tmp_path: Path) -> None:
    model_path, data = _saved_with_data(tmp_path, 3)
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(model_path), "--data", str(data), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "judged: the target judges prob; state outputs are reported, not judged: stateN" in r.output
    assert "judged outputs: " in r.output and " dB pooled on the 16 samples compared below" in r.output
    named = runner.invoke(
        app, ["quantize", str(model_path), "--data", str(data), "-o", str(out), "--outputs", "stateN"]
    )
    assert named.exit_code == 0, named.output
    assert "the target judges the outputs named: stateN" in named.output
    wrong = runner.invoke(app, ["quantize", str(model_path), "--data", str(data), "-o", str(out), "--outputs", "nope"])
    assert wrong.exit_code == 2 and "'nope' names no output" in wrong.output


def test_tune_judges_the_outputs_named(tmp_path: Path) -> None:
    model_path, data = _saved_with_data(tmp_path, 4)
    args = ["tune", str(model_path), "--data", str(data), "--eval", str(data), "-o", str(tmp_path / "t.onnx")]
    args += ["--config-out", str(tmp_path / "t.yaml"), "--target-sqnr", "25", "--time-budget", "30", "--no-cache"]
    wrong = runner.invoke(app, [*args, "--outputs", "nope"])
    assert wrong.exit_code == 2 and "'nope' names no output" in wrong.output
    r = runner.invoke(app, [*args, "--outputs", "prob"])
    assert r.exit_code in (0, 1), r.output
    assert (tmp_path / "t.onnx").exists()


def _cached(layers: int = 4) -> onnx.ModelProto:
    """An FSMN-style streaming model: a chunk and one cache per layer in, logits and each next cache out."""
    rng = np.random.default_rng(11)
    nodes, inits, x = [], [], "speech"
    inputs = [helper.make_tensor_value_info("speech", TensorProto.FLOAT, [1, 8])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 8])]
    for k in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), f"w{k}"))
        nodes += [
            helper.make_node("Add", [x, f"in_cache{k}"], [f"mix{k}"], name=f"mix{k}"),
            helper.make_node("MatMul", [f"mix{k}", f"w{k}"], [f"out_cache{k}"], name=f"mm{k}"),
        ]
        inputs.append(helper.make_tensor_value_info(f"in_cache{k}", TensorProto.FLOAT, [1, 8]))
        outputs.append(helper.make_tensor_value_info(f"out_cache{k}", TensorProto.FLOAT, [1, 8]))
        x = f"out_cache{k}"
    nodes.append(helper.make_node("Identity", [x], ["logits"], name="head"))
    graph = helper.make_graph(nodes, "fsmn", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_numbered_caches_pair_with_the_input_of_the_same_number() -> None:
    judged = judged_outputs(_cached())
    assert judged.state == {f"out_cache{k}": f"in_cache{k}" for k in range(4)}
    assert judged.judged == ("logits",)


def test_the_config_gives_the_state_pairs_and_they_are_checked() -> None:
    model = _cached(2)
    given = (("out_cache0", "in_cache1"), ("out_cache1", "in_cache0"))
    assert judged_outputs(model, pairs=given).state == dict(given)
    with pytest.raises(QtoolError, match="'nope' is no output"):
        judged_outputs(model, pairs=(("nope", "in_cache0"),))
    with pytest.raises(QtoolError, match=r"'speech2' .* is no input"):
        judged_outputs(model, pairs=(("out_cache0", "speech2"),))


def test_naming_the_judged_outputs_keeps_the_state_carried() -> None:
    judged = judged_outputs(_cached(2), ["logits"])
    assert judged.judged == ("logits",) and judged.state == {"out_cache0": "in_cache0", "out_cache1": "in_cache1"}
    assert "state fed back: out_cache0 -> in_cache0" in judged.note()


def test_accuracy_state_in_a_config_reaches_quantize(tmp_path: Path) -> None:
    model_path, data = tmp_path / "fsmn.onnx", tmp_path / "data"
    onnx.save(_cached(2), model_path)
    data.mkdir()
    rng = np.random.default_rng(5)
    for i in range(16):
        np.savez(
            data / f"{i:02d}.npz",
            speech=rng.standard_normal((1, 8)).astype(np.float32),
            in_cache0=np.zeros((1, 8), np.float32),
            in_cache1=np.zeros((1, 8), np.float32),
        )
    config = tmp_path / "c.yaml"
    config.write_text("accuracy:\n  state:\n    out_cache0: in_cache1\n    out_cache1: in_cache0\n")
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(model_path), "--config", str(config), "--data", str(data), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "out_cache0 (fed back as in_cache1)" in r.output
    config.write_text("accuracy:\n  state:\n    out_cache0: nope\n")
    wrong = runner.invoke(
        app, ["quantize", str(model_path), "--config", str(config), "--data", str(data), "-o", str(out)]
    )
    assert wrong.exit_code == 2 and "'nope' (fed by out_cache0) is no input" in wrong.output


def _end_to_end_detector() -> onnx.ModelProto:
    """Scores and boxes from a 1x1 convolution head, then the 5 best rows picked and ordered by TopK (a NMS-free
    detector's export): 'detections' [1, 5, 4] are boxes gathered by the TopK indices, 'raw' is not selected."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array((rng.standard_normal((5, 8, 1, 1)) * 0.5).astype(np.float32), "head"),
        numpy_helper.from_array(np.array([5], np.int64), "k"),
        numpy_helper.from_array(np.array([1, 5, 64], np.int64), "flat"),
        numpy_helper.from_array(np.array([1, 4], np.int64), "sizes"),
        numpy_helper.from_array(np.array([1], np.int64), "channel_axis"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "head"], ["maps"], name="head_conv"),
        helper.make_node("Reshape", ["maps", "flat"], ["rows"], name="flatten"),
        helper.make_node("Split", ["rows", "sizes"], ["scores", "boxes"], name="split", axis=1),
        helper.make_node("ReduceMax", ["scores", "channel_axis"], ["best"], name="best", keepdims=0),
        helper.make_node("TopK", ["best", "k"], ["top", "picked"], name="select", axis=1),
        helper.make_node("Transpose", ["boxes"], ["by_row"], name="rows_first", perm=[0, 2, 1]),
        helper.make_node("Gather", ["by_row", "picked"], ["gathered"], name="gather", axis=1),
        helper.make_node("Squeeze", ["gathered"], ["detections"], name="squeeze"),
    ]
    graph = helper.make_graph(
        nodes,
        "e2e",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 8, 8, 8])],
        [
            helper.make_tensor_value_info("detections", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("maps", TensorProto.FLOAT, [1, 5, 8, 8]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_an_output_a_topk_orders_is_said_to_be_ordered_by_it(tmp_path: Path) -> None:
    model = _end_to_end_detector()
    judged = judged_outputs(model)
    assert judged.reordered == {"detections": "TopK 'select'"} and judged.subset is None
    assert "'detections' (by TopK 'select')" in judged.note() and "compared as sets of rows" in judged.note()
    # a candidate returning the same rows in reverse order: exact as a set, in compare's report too
    path, reversed_rows, data = tmp_path / "e2e.onnx", tmp_path / "reversed.onnx", tmp_path / "data"
    onnx.save(model, path)
    flipped = onnx.ModelProto()
    flipped.CopyFrom(model)
    squeeze = next(n for n in flipped.graph.node if n.name == "squeeze")
    squeeze.output[0] = "in_order"
    flipped.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(v, np.int64), n)
            for n, v in (("s", [-1]), ("e", [-9]), ("ax", [0]), ("st", [-1]))
        ]
    )
    flipped.graph.node.append(
        helper.make_node("Slice", ["in_order", "s", "e", "ax", "st"], ["detections"], name="flip")
    )
    onnx.save(flipped, reversed_rows)
    data.mkdir()
    rng = np.random.default_rng(4)
    for i in range(4):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 8, 8, 8)).astype(np.float32))
    r = runner.invoke(
        app,
        [
            "compare",
            str(path),
            str(reversed_rows),
            "--data",
            str(data),
            "--runs",
            "0",
            "--json",
            str(tmp_path / "r.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "rows ordered by a selection in the graph: 'detections' (by TopK 'select')" in r.output
    outputs = {o["name"]: o for o in json.loads((tmp_path / "r.json").read_text())["accuracy"]["outputs"]}
    assert outputs["detections"]["sqnr_db"] is None or outputs["detections"]["sqnr_db"] > 100  # exact: +inf
    # and so the placement choice scores it
    from qtool.calibration.dataset import Dataset, model_inputs
    from qtool.evaluation.scoring import OutputScorer

    scorer = OutputScorer(model, Dataset(data, model_inputs(model)))
    assert scorer.score(flipped).outputs["detections"] == float("inf")


def test_rows_are_paired_nearest_first_and_a_moved_row_costs_its_move() -> None:
    from qtool.evaluation.row_matching import MAX_MATCHED_ROWS, matched_rows

    rng = np.random.default_rng(0)
    reference = rng.standard_normal((1, 40, 6)).astype(np.float32)
    shuffled = reference[:, rng.permutation(40)]
    assert np.array_equal(matched_rows(reference, shuffled), reference)
    moved = shuffled.copy()
    moved[0, 3] += 0.01
    assert np.abs(matched_rows(reference, moved) - reference).max() == pytest.approx(0.01, abs=1e-6)
    many = rng.standard_normal((MAX_MATCHED_ROWS + 1, 2)).astype(np.float32)
    assert matched_rows(many, many[::-1]) is not None and np.array_equal(matched_rows(many, many[::-1]), many[::-1])
