"""Recurrent ops' weights (LSTM, GRU, RNN): stored quantized, restored at load, the op computing in float.

The model is built here: a MatMul projection, a bidirectional LSTM, a GRU and an RNN in a row, then a MatMul
head, as a CRNN recogniser or a speech model has them; a second model holds an LSTM inside an If branch that
reads its weights from the outer scope. Each is quantized with data, re-read from disk, run by onnxruntime and
compared with the float model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.graph.index import node_subgraphs
from tests.conftest import save_checked

runner = CliRunner()
RNG = np.random.default_rng(7)
T, WIDTH, HIDDEN = 12, 16, 24
SHAPE = [T, 1, 2 * HIDDEN]  # the bidirectional LSTM's output, directions side by side
RECURRENT_WEIGHTS = ("lstm_w", "lstm_r", "gru_w", "gru_r", "rnn_w", "rnn_r")


def _w(name: str, *shape: int, scale: float = 0.2) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _recurrent_nodes(x: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """LSTM (both directions) -> GRU -> RNN on ``x`` [T, 1, WIDTH]; returns the nodes, weights and the output."""
    h = HIDDEN
    inits = [
        _w("lstm_w", 2, 4 * h, WIDTH),
        _w("lstm_r", 2, 4 * h, h),
        _w("lstm_b", 2, 8 * h, scale=0.05),
        _w("gru_w", 1, 3 * h, 2 * h),
        _w("gru_r", 1, 3 * h, h),
        _w("rnn_w", 1, h, h),
        _w("rnn_r", 1, h, h),
        numpy_helper.from_array(np.array([T, 1, 2 * h], np.int64), "both_directions"),
    ]
    nodes = [
        helper.make_node(
            "LSTM", [x, "lstm_w", "lstm_r", "lstm_b"], ["ly"], hidden_size=h, direction="bidirectional", name="lstm"
        ),
        helper.make_node("Transpose", ["ly"], ["lt"], perm=[0, 2, 1, 3], name="lstm_t"),
        helper.make_node("Reshape", ["lt", "both_directions"], ["lr"], name="lstm_r2"),
        helper.make_node("GRU", ["lr", "gru_w", "gru_r"], ["gy", ""], hidden_size=h, linear_before_reset=1, name="gru"),
        helper.make_node("Squeeze", ["gy", "one"], ["gs"], name="gru_s"),
        helper.make_node("RNN", ["gs", "rnn_w", "rnn_r"], ["ry", ""], hidden_size=h, name="rnn"),
        helper.make_node("Squeeze", ["ry", "one"], ["rs"], name="rnn_s"),
    ]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    return nodes, inits, "rs"


def _data(folder: Path, n: int = 16) -> Path:
    folder.mkdir()
    for i in range(n):
        np.save(folder / f"{i:03d}.npy", RNG.standard_normal((T, 1, WIDTH)).astype(np.float32))
    return folder


@pytest.fixture(scope="module")
def crnn(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("crnn")
    nodes, inits, out = _recurrent_nodes("p")
    nodes = [helper.make_node("MatMul", ["x", "proj_w"], ["p"], name="proj"), *nodes]
    nodes.append(helper.make_node("MatMul", [out, "head_w"], ["logits"], name="head"))
    inits += [_w("proj_w", WIDTH, WIDTH), _w("head_w", HIDDEN, 10)]
    graph = helper.make_graph(
        nodes,
        "crnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 1, WIDTH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [T, 1, 10])],
        inits,
    )
    return save_checked(graph, folder / "crnn.onnx"), _data(folder / "data")


def _sqnr(model: Path, quantized: Path, data: Path) -> float:
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    candidate = ort.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])
    signal = noise = 0.0
    for f in sorted(data.glob("*.npy")):
        feed = {"x": np.load(f)}
        r, c = reference.run(None, feed)[0].astype(np.float64), candidate.run(None, feed)[0]
        signal, noise = signal + float(np.sum(r**2)), noise + float(np.sum((r - c) ** 2))
    return 10 * np.log10(signal / noise)


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in model.graph.initializer}


def test_lstm_gru_and_rnn_weights_are_stored_int8_per_gate_row_and_the_model_stays_accurate(crnn, tmp_path):
    model, data = crnn
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    result = runner.invoke(app, ["quantize", str(model), "--data", str(data), "-o", str(out), "--json", str(report)])
    assert result.exit_code == 0, result.output
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    inits = _initializers(quantized)
    original = _initializers(onnx.load(str(model)))
    for name in RECURRENT_WEIGHTS:
        assert name not in inits, name  # no float copy left
        stored = [i for k, i in inits.items() if k.startswith(f"{name}/quantized")]
        assert len(stored) == 1 and stored[0].data_type == TensorProto.INT8, name
        scales = numpy_helper.to_array(inits[f"{name}/scale"])
        assert scales.shape == (1, original[name].dims[1], 1), name  # one scale per gate row (restored by Mul)
    assert inits["lstm_b"].data_type == TensorProto.FLOAT  # the bias stays float
    # the ops read the restored weights and still compute in float
    ops = {n.name: n for n in quantized.graph.node}
    assert ops["lstm"].input[1] != "lstm_w" and ops["lstm"].op_type == "LSTM"
    assert _sqnr(model, out, data) > 35
    assert (
        model.stat().st_size / out.stat().st_size > 2.8
    )  # float 4 bytes -> int8 1 byte, every weight stored (biases float)
    document = json.loads(report.read_text())
    assert {"lstm", "gru", "rnn"} <= set(document["quantized"]["nodes"])
    assert set(RECURRENT_WEIGHTS) <= set(document["quantized"]["weights"])
    assert not {"LSTM", "GRU", "RNN"} & set(document["passthrough_ops"])


def test_a_rule_that_keeps_lstm_float_leaves_its_weights_alone_and_inspect_lists_the_others(crnn, tmp_path):
    model, data = crnn
    config = tmp_path / "c.yaml"
    config.write_text("op_type: {LSTM: null}\n")
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, config_path=config, search=None, evaluation=None)
    inits = _initializers(onnx.load(str(out)))
    assert inits["lstm_w"].data_type == TensorProto.FLOAT and inits["lstm_r"].data_type == TensorProto.FLOAT
    assert "gru_w" not in inits and "rnn_r" not in inits
    inspection = qtool.inspect(model, config_path=config)
    rows = {r.name: r for r in inspection.rows}
    assert {"gru (gru_w)", "gru (gru_r)", "rnn (rnn_w)", "rnn (rnn_r)"} <= set(rows)
    assert not any(name.startswith("lstm") for name in rows)
    assert rows["gru (gru_w)"].placement == "storage" and rows["gru (gru_w)"].predicted_kernel == "float GRU"
    assert rows["gru (gru_w)"].quantized_bytes < rows["gru (gru_w)"].float_bytes / 3
    assert inspection.passthrough.get("LSTM") == 1


def _if_model(then_branch: onnx.GraphProto, else_branch: onnx.GraphProto, path: Path) -> tuple[Path, Path]:
    """An If on a boolean input between two branches that read the LSTM's weights from the outer scope; its data."""
    _, inits, _ = _recurrent_nodes("x")
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], then_branch=then_branch, else_branch=else_branch, name="branch")],
        "if_lstm",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 1, WIDTH]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
        [i for i in inits if i.name.startswith("lstm") or i.name == "both_directions"],
    )
    data = path.parent / "data"
    data.mkdir()
    for i in range(8):  # both branches run (the first test's else branch holds no weight)
        x = RNG.standard_normal((T, 1, WIDTH)).astype(np.float32)
        np.savez(data / f"{i:03d}.npz", x=x, flag=np.array(i % 2 == 0))
    return save_checked(graph, path), data


def _branch(tag: str) -> onnx.GraphProto:
    """The LSTM (and its output's layout ops) as an If branch, its tensors and nodes named after ``tag``."""
    nodes = _recurrent_nodes("x")[0][:3]
    for node in nodes:
        node.name = f"{tag}/{node.name}"
        node.output[:] = [f"{tag}_{o}" if o else "" for o in node.output]
        node.input[:] = [f"{tag}_{i}" if i in ("ly", "lt") else i for i in node.input]
    return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(f"{tag}_lr", TensorProto.FLOAT, SHAPE)])


def _quantized_if_model(model: Path, data: Path) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """Quantize, check and re-read; compare with the float model on both branches; the initializers at any depth."""
    out = model.with_name("q.onnx")
    qtool.quantize(model, out, data_dir=data, search=None, evaluation=None)
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    candidate = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for flag in (True, False):
        feed = {"x": np.load(data / "000.npz")["x"], "flag": np.array(flag)}
        r, c = reference.run(None, feed)[0], candidate.run(None, feed)[0]
        noise = max(float(np.sum((r.astype(np.float64) - c) ** 2)), 1e-30)  # a branch without weights is exact
        assert 10 * np.log10(np.sum(r.astype(np.float64) ** 2) / noise) > 35, flag
    graphs = [quantized.graph, *(a.g for a in quantized.graph.node[0].attribute if a.type == onnx.AttributeProto.GRAPH)]
    return quantized, {i.name: i for g in graphs for i in g.initializer}


def test_an_lstm_inside_an_if_branch_reading_outer_weights_gets_them_stored(tmp_path):
    assert 3 * WIDTH == 2 * HIDDEN  # the else branch widens x to the LSTM's output width
    widen = helper.make_node("Concat", ["x", "x", "x"], ["lr"], axis=2, name="widen")
    else_branch = helper.make_graph(
        [widen], "else", [], [helper.make_tensor_value_info("lr", TensorProto.FLOAT, SHAPE)]
    )
    model, data = _if_model(_branch("then"), else_branch, tmp_path / "if_lstm.onnx")
    quantized, inits = _quantized_if_model(model, data)
    # the branch alone reads them: they move into it (see docs/control-flow.md), stored int8 there, no float copy
    assert "lstm_w" not in inits and "lstm_r" not in inits
    assert inits["lstm_w/quantized"].data_type == TensorProto.INT8
    assert inits["lstm_r/quantized"].data_type == TensorProto.INT8
    assert not {"lstm_w/quantized", "lstm_r/quantized"} & {i.name for i in quantized.graph.initializer}


def test_lstms_in_both_branches_sharing_outer_weights_read_one_stored_copy(tmp_path):
    model, data = _if_model(_branch("then"), _branch("else"), tmp_path / "shared_lstm.onnx")
    quantized, _ = _quantized_if_model(model, data)
    inits = _initializers(quantized)  # read by both branches: stored once in the main graph
    assert "lstm_w" not in inits and "lstm_r" not in inits
    assert inits["lstm_w/quantized"].data_type == TensorProto.INT8
    assert inits["lstm_r/quantized"].data_type == TensorProto.INT8


def test_the_search_keeps_an_lstm_float_when_its_stored_weights_cost_the_target(crnn, tmp_path):
    model, data = crnn
    config = tmp_path / "c.yaml"  # 2-bit LSTM weights: storage-only misses 30 dB, so the search may move it
    config.write_text("op_type: {LSTM: {weight: {dtype: int2, granularity: per_channel}}}\n")
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, config_path=config, evaluation=None)
    assert result.search is not None and "lstm" in result.search.kept_nodes
    inits = _initializers(onnx.load(str(out)))
    assert inits["lstm_w"].data_type == TensorProto.FLOAT and inits["lstm_r"].data_type == TensorProto.FLOAT
    assert _sqnr(model, out, data) > 30


def _widen(tag: str) -> onnx.GraphProto:
    widen = helper.make_node("Concat", ["x", "x", "x"], [f"{tag}_lr"], axis=2, name=f"{tag}/widen")
    return helper.make_graph([widen], tag, [], [helper.make_tensor_value_info(f"{tag}_lr", TensorProto.FLOAT, SHAPE)])


def test_the_search_may_keep_an_lstm_inside_a_nested_branch_float(tmp_path):
    # the LSTM sits in an If inside an If branch, its weights in that inner branch's own plan
    inner = helper.make_node("If", ["flag"], ["inner_y"], then_branch=_branch("then"), else_branch=_widen("in_else"))
    inner.name = "inner"
    outer_then = helper.make_graph(
        [inner], "outer_then", [], [helper.make_tensor_value_info("inner_y", TensorProto.FLOAT, SHAPE)]
    )
    model, data = _if_model(outer_then, _widen("out_else"), tmp_path / "nested_lstm.onnx")
    config = tmp_path / "c.yaml"  # 2-bit LSTM weights: storage-only misses 30 dB on the samples that take the branch
    config.write_text("op_type: {LSTM: {weight: {dtype: int2, granularity: per_channel}}}\n")
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, config_path=config, evaluation=None)
    assert result.search is not None and "then/lstm" in result.search.kept_nodes
    quantized = onnx.load(str(out))
    onnx.checker.check_model(quantized, full_check=True)
    graphs = [quantized.graph, *(body for node in quantized.graph.node for body in node_subgraphs(node))]
    graphs += [body for g in graphs[1:] for node in g.node for body in node_subgraphs(node)]
    inits = {i.name: i for g in graphs for i in g.initializer}
    assert inits["lstm_w"].data_type == TensorProto.FLOAT and "lstm_w/quantized" not in inits
