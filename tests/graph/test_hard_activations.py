"""Hard-sigmoid and hard-swish written out as Add/Clip/Div/Mul (paddle2onnx, tf2onnx): rewritten as HardSigmoid."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.graph.prepare import prepare_model
from tests.conftest import run_model, save_checked

CHANNELS, SIDE = 8, 12


def _constants(**values: float) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(np.array([v], np.float32), name) for name, v in values.items()]


def _relu6_plus_three(x: str, out: str, *, opset: int = 17, three: float = 3.0, six: float = 6.0) -> list:
    """``Clip(x + 3, 0, 6)`` as an exporter writes it (bounds as inputs from opset 11, attributes before)."""
    add = helper.make_node("Add", [x, "three"], [f"{out}/plus3"], name=f"{out}/add")
    if opset >= 11:
        clip = helper.make_node("Clip", [f"{out}/plus3", "zero", "six"], [out], name=f"{out}/clip")
    else:
        clip = helper.make_node("Clip", [f"{out}/plus3"], [out], name=f"{out}/clip", min=0.0, max=six)
    return [add, clip], _constants(three=three, zero=0.0, six=six)


def _model(path: Path, form: str, *, opset: int = 17, **bounds: float) -> Path:
    """A Conv, then one hard activation in ``form``, then a Conv; the output is the second Conv's."""
    rng = np.random.default_rng(0)
    gate, constants = _relu6_plus_three("a", "gate", opset=opset, **bounds)
    tail = {
        "paddle": [  # Div(Mul(x, relu6(x + 3)), 6)
            helper.make_node("Mul", ["a", "gate"], ["prod"], name="mul"),
            helper.make_node("Div", ["prod", "six_div"], ["act"], name="div"),
        ],
        "tf": [  # Mul(1/6, Mul(relu6(3 + x), x)), operands the other way round
            helper.make_node("Mul", ["gate", "a"], ["prod"], name="mul"),
            helper.make_node("Mul", ["sixth", "prod"], ["act"], name="scale"),
        ],
        "se_gate": [  # x * (relu6(x + 3) / 6): the gate alone is a hard-sigmoid
            helper.make_node("Div", ["gate", "six_div"], ["hsig"], name="div"),
            helper.make_node("Mul", ["a", "hsig"], ["act"], name="mul"),
        ],
        "op": [helper.make_node("HardSwish", ["a"], ["act"], name="hardswish")],  # opset 14's op, gate unused
        "other_operand": [  # y * relu6(x + 3) / 6: not a hard-swish (y is not x)
            helper.make_node("Mul", ["b", "gate"], ["prod"], name="mul"),
            helper.make_node("Div", ["prod", "six_div"], ["act"], name="div"),
        ],
    }[form]
    weight = rng.standard_normal((CHANNELS, CHANNELS, 3, 3)).astype(np.float32) * 0.3
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w0"], ["b"], name="conv0", pads=[1, 1, 1, 1]),
        *(gate if form != "op" else []),
        *tail,
        helper.make_node("Conv", ["act", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    constants += _constants(six_div=6.0, sixth=1 / 6)
    constants += [numpy_helper.from_array(w, name) for name, w in (("w0", weight), ("w1", weight[::-1].copy()))]
    constants.append(numpy_helper.from_array(weight.transpose(1, 0, 2, 3).copy(), "w2"))
    shape = [1, CHANNELS, SIDE, SIDE]
    graph = helper.make_graph(
        nodes,
        form,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        constants,
    )
    return save_checked(graph, path, opset=opset)


def _feed() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).uniform(-4, 4, (1, CHANNELS, SIDE, SIDE)).astype(np.float32)}


def _samples(folder: Path, seed: int) -> Path:
    """Eight calibration samples spanning the hard activation's bends (-3 and 3)."""
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(8):
        np.save(folder / f"{i:03d}.npy", rng.uniform(-4, 4, (1, CHANNELS, SIDE, SIDE)).astype(np.float32))
    return folder


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


@pytest.mark.parametrize(
    ("form", "opset", "ops"),
    [
        ("paddle", 13, {"HardSigmoid": 1, "Mul": 1}),
        ("paddle", 10, {"HardSigmoid": 1, "Mul": 1}),  # Clip's bounds as attributes
        ("tf", 17, {"HardSigmoid": 1, "Mul": 1}),
        ("se_gate", 13, {"HardSigmoid": 1, "Mul": 1}),
        ("op", 14, {"HardSigmoid": 1, "Mul": 1, "HardSwish": 0}),
    ],
)
def test_a_written_out_hard_activation_becomes_hard_sigmoid_and_computes_the_same(tmp_path, form, opset, ops):
    path = _model(tmp_path / "m.onnx", form, opset=opset)
    prepared, report = prepare_model(onnx.load(str(path)))
    assert report.hard_activations == ["act" if form != "se_gate" else "hsig"]
    counts = _ops(prepared)
    assert {op: counts[op] for op in ops} == ops
    assert counts["Clip"] == counts["Div"] == counts["Add"] == 0  # the constants 3, 0, 6 and 1/6 are gone too
    hard_sigmoid = next(n for n in prepared.graph.node if n.op_type == "HardSigmoid")
    assert hard_sigmoid.input == ["a"]
    assert {a.name: a.f for a in hard_sigmoid.attribute} == pytest.approx({"alpha": 1 / 6, "beta": 0.5})
    onnx.checker.check_model(prepared, full_check=True)
    feed = _feed()
    reference, rewritten = run_model(path, feed)[0], run_model(prepared.SerializeToString(), feed)[0]
    np.testing.assert_allclose(rewritten, reference, rtol=1e-5, atol=1e-5 * float(np.abs(reference).max()))


@pytest.mark.parametrize(
    ("form", "bounds"),
    [
        ("paddle", {"three": 2.5}),  # not x + 3
        ("paddle", {"six": 5.0}),  # relu5, and a division by 5 would not match either
        ("other_operand", {}),
    ],
)
def test_what_is_not_exactly_a_hard_activation_is_left_as_written(tmp_path, form, bounds):
    path = _model(tmp_path / "m.onnx", form, **bounds)
    prepared, report = prepare_model(onnx.load(str(path)))
    assert report.hard_activations == []
    assert _ops(prepared)["Clip"] == 1 and _ops(prepared)["HardSigmoid"] == 0


def test_a_tensor_of_the_pattern_read_elsewhere_keeps_the_pattern(tmp_path):
    """The product x * relu6(x + 3) is also a graph output: removing it would change what the model returns."""
    path = _model(tmp_path / "m.onnx", "paddle")
    model = onnx.load(str(path))
    model.graph.output.append(helper.make_tensor_value_info("prod", TensorProto.FLOAT, [1, CHANNELS, SIDE, SIDE]))
    prepared, report = prepare_model(model)
    assert report.hard_activations == []
    assert _ops(prepared)["Div"] == 1


@pytest.mark.parametrize("form", ["paddle", "op"])
def test_between_integer_convs_the_hard_swish_multiplies_in_8_bits(tmp_path, form):
    """Only the HardSigmoid stays float: its product with x is onnxruntime's QLinearMul, as in its own quantizer's."""
    path = _model(tmp_path / "m.onnx", form, opset=14)
    data = _samples(tmp_path / "data", seed=3)
    config = tmp_path / "c.yaml"
    config.write_text("version: 1\nglobal: {placement: integer}\n")
    out = tmp_path / "q.onnx"
    result = qtool.quantize(path, out, data_dir=data, config_path=config, search=None, evaluation=None)
    assert result.kernels["QLinearMul"] == 1 and result.kernels["QLinearConv"] == 3, result.kernels
    optimized = tmp_path / "optimized.onnx"
    options = ort.SessionOptions()
    options.log_severity_level, options.optimized_model_filepath = 3, str(optimized)
    ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    ops = _ops(onnx.load(str(optimized)))
    assert ops["QLinearMul"] == 1 and ops["HardSigmoid"] == 1 and ops["Mul"] == 0, ops


def test_quantize_reports_the_rewrite_and_its_model_tracks_the_float_one(tmp_path):
    path = _model(tmp_path / "m.onnx", "paddle", opset=13)
    data = _samples(tmp_path / "data", seed=2)
    out = tmp_path / "q.onnx"
    result = qtool.quantize(path, out, data_dir=data, search=None, evaluation=None)
    assert result.prepare.hard_activations == ["act"]
    written = onnx.load(str(out))
    assert _ops(written)["HardSigmoid"] == 1 and _ops(written)["Clip"] == 0
    feed = {"x": np.load(data / "000.npy")}
    reference, candidate = run_model(path, feed)[0], run_model(out, feed)[0]
    sqnr = 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - candidate) ** 2))
    assert sqnr > 25


def test_inspect_says_what_preparation_rewrote(tmp_path):
    path = _model(tmp_path / "m.onnx", "paddle", opset=13)
    result = CliRunner().invoke(app, ["inspect", str(path), "--json", str(tmp_path / "i.json")])
    assert result.exit_code == 0, result.output
    assert "1 hard-sigmoid/swish" in result.output and "-> HardSigmoid" in result.output
    document = json.loads((tmp_path / "i.json").read_text())
    assert document["prepare"]["hard_activations"] == ["act"]
