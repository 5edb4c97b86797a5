"""Samples past a candidate's quantized input range are told, by name, where compare scores held-out samples."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from qtool.cli import app
from qtool.evaluation.clipped_inputs import clipped_inputs, quantized_input_ranges

runner = CliRunner()


def _graph(quantized: bool, in_body: bool) -> onnx.GraphProto:
    """Relu(x); ``quantized``: x quantized to uint8 at scale 0.01, zero point 128 ([-1.28, 1.27]) as it is read;
    ``in_body``: behind a reflect Pad and an Unsqueeze inside an If's branch, as a Silero VAD export holds it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    read = "r"
    nodes = [helper.make_node("Identity", ["x"], ["r"])]
    consts = []
    if in_body:
        consts += [
            numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("pads", [0, 2, 0, 2]), ("axes", [0]))
        ]
        nodes = [
            helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
            helper.make_node("Unsqueeze", ["p", "axes"], ["r"]),
        ]
    if quantized:
        consts += [numpy_helper.from_array(np.array(0.01, np.float32), "s")]
        consts += [numpy_helper.from_array(np.array(128, np.uint8), "z")]
        nodes += [
            helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        ]
        read = "d"
    if not in_body:
        return helper.make_graph([*nodes, helper.make_node("Relu", [read], ["y"])], "g", [x], [y], consts)
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    body = helper.make_graph([*nodes, helper.make_node("Relu", [read], ["out"])], "then", [], [out], consts)
    other = helper.make_graph(
        [
            helper.make_node("Pad", ["x", "pads2"], ["r2"], mode="reflect"),
            helper.make_node("Unsqueeze", ["r2", "axes2"], ["out2"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("out2", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("pads2", [0, 2, 0, 2]), ("axes2", [0]))],
    )
    flag = numpy_helper.from_array(np.array(True), "flag")
    return helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], then_branch=body, else_branch=other)], "g", [x], [y], [flag]
    )


def _models(folder, in_body: bool):
    folder.mkdir(exist_ok=True)
    paths = folder / "f.onnx", folder / "q.onnx"
    for quantized, path in zip((False, True), paths, strict=True):
        model = helper.make_model(_graph(quantized, in_body), opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, str(path))
    return paths


def _samples(folder, peak: float):
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        values = rng.uniform(-1.0, 1.0, (1, 16)).astype(np.float32)
        if i in (2, 4):
            values[0, 3] = peak
        np.save(folder / f"{i:03d}.npy", values)
    return folder


def test_the_range_is_read_through_value_keeping_ops_and_bodies(tmp_path):
    for in_body in (False, True):
        reference, candidate = _models(tmp_path / str(in_body), in_body)
        assert quantized_input_ranges(onnx.load(str(reference))) == []
        (found,) = quantized_input_ranges(onnx.load(str(candidate)))
        assert found.name == "x"
        np.testing.assert_allclose((found.low, found.high, found.step), (-1.28, 1.27, 0.01), rtol=1e-6)
    feeds = [{"x": np.array([0.5, -2.1])}, {"x": np.array([2.0])}, {"x": np.array([1.5])}]
    (clipped,) = clipped_inputs([found], feeds)  # 1.5 is past by less than a quarter of the width
    assert (clipped.samples, clipped.of, clipped.farthest) == (2, 3, -2.1)


def test_compare_on_louder_samples_names_the_input_and_how_many_reach_past(tmp_path):
    reference, candidate = _models(tmp_path, in_body=True)
    loud, quiet = _samples(tmp_path / "loud", 2.5), _samples(tmp_path / "quiet", 1.5)
    r = runner.invoke(app, ["compare", str(reference), str(candidate), "--data", str(loud), "--runs", "0"])
    assert r.exit_code == 0, r.output
    assert (
        f"input 'x' is quantized to [-1.28, 1.27] as it is read, and 2 of 6 samples of {loud} reach past it" in r.stderr
    )
    assert "(to 2.5)" in r.stderr
    r = runner.invoke(app, ["compare", str(reference), str(candidate), "--data", str(quiet), "--runs", "0"])
    assert r.exit_code == 0 and "reach past it" not in r.stderr
