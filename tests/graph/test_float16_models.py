"""float16 models: quantized from their float32 form, written with their float16 inputs, outputs and float weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.graph.float16 import has_float16, upcast_float16
from qtool.graph.weights import Weights
from tests.conftest import calib_dir, eval_dir, sample


def _to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (float32) exported as float16: weights, inputs, outputs and casts."""
    half = onnx.ModelProto()
    half.CopyFrom(model)
    graph = half.graph
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            values = np.clip(numpy_helper.to_array(init), -65504, 65504)  # as exporters clip masks' -inf stand-ins
            init.CopyFrom(numpy_helper.from_array(values.astype(np.float16), init.name))
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    del graph.value_info[:]
    return half


def _float16_samples(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in sorted(source.glob("*.npy")):
        np.save(target / path.name, np.load(path).astype(np.float16))
    return target


def _run(path: Path | onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    model = path.SerializeToString() if isinstance(path, onnx.ModelProto) else str(path)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_upcast_computes_in_float32_behind_the_float16_interface():
    # a float16 graph with a cast to float16, a float16 constant and a float16 annotation inside
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 3])
    w = numpy_helper.from_array(np.linspace(-2, 2, 9).reshape(3, 3).astype(np.float16), "w")
    one = helper.make_tensor("one", TensorProto.FLOAT16, [1], [1.0])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], "mm"),
        helper.make_node("Cast", ["h"], ["h32"], "up", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["h32"], ["h16"], "down", to=TensorProto.FLOAT16),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], "fill", value=one),
        helper.make_node("Add", ["h16", "ones"], ["y"], "add"),
    ]
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
    graph = helper.make_graph(nodes, "g", [x], [y], [w, shape], value_info=[
        helper.make_tensor_value_info("h16", TensorProto.FLOAT16, [2, 3])])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    data = np.arange(6, dtype=np.float16).reshape(2, 3) / 4
    expected = _run(model, data)

    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    assert has_float16(wide.graph)
    assert upcast_float16(wide.graph, Weights()) == ["w"]
    onnx.checker.check_model(wide, full_check=True)
    inside = [n for n in wide.graph.node if n.name not in ("x/to_float32", "y/to_float16")]
    assert not has_float16(helper.make_graph(inside, "inside", [], [], list(wide.graph.initializer)))
    assert [v.type.tensor_type.elem_type for v in [*wide.graph.input, *wide.graph.output]] == [TensorProto.FLOAT16] * 2
    got = _run(wide, data)
    assert got.dtype == np.float16 and np.allclose(got, expected, rtol=2e-3, atol=2e-3)
    assert not has_float16(onnx.load(sample("mlp")).graph)  # a float32 model is left as it is


def test_upcast_keeps_outputs_that_are_inputs_or_weights():
    # a model that returns its input unchanged and a constant, beside a computed output
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [4]) for n in ("x", "table", "y")]
    table = numpy_helper.from_array(np.linspace(-1, 1, 4).astype(np.float16), "table")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "table"], ["y"], "mul")], "g", [x], outputs, [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = np.array([0.5, -2, 3, 1e-3], np.float16)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": data})
    upcast_float16(model.graph, Weights())
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": data})
    assert [g.dtype for g in got] == [np.float16] * 3
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


def test_a_float16_model_quantizes_to_a_smaller_float16_model(tmp_path):
    source = tmp_path / "mlp16.onnx"
    onnx.save(_to_float16(onnx.load(sample("mlp"))), source)
    calib = _float16_samples(calib_dir("mlp"), tmp_path / "calib")
    held = _float16_samples(eval_dir("mlp"), tmp_path / "eval")
    config = tmp_path / "c.yaml"
    config.write_text('exclude: ["fc2/matmul"]\n')
    out = tmp_path / "q.onnx"
    before = source.read_bytes()
    result = qtool.quantize(source, out, config_path=config, data_dir=calib, evaluation=None)
    assert source.read_bytes() == before  # the input is never modified
    assert any("computes in float16" in note for note in result.notes)
    written = onnx.load(out)
    assert [v.type.tensor_type.elem_type for v in [*written.graph.input, *written.graph.output]] == [
        TensorProto.FLOAT16
    ] * 2
    stored = {init.name: init.data_type for init in written.graph.initializer}
    # the weight kept in float stays float16 (cast back at load); the quantized ones are 8-bit
    assert stored.get("fc2.weight/float16") == TensorProto.FLOAT16 and "fc2.weight" not in stored
    assert sum(t in (TensorProto.INT8, TensorProto.UINT8) for t in stored.values()) >= 2
    assert result.compression_ratio > 1.5  # against the float16 source, not its float32 form
    errors, signal = 0.0, 0.0
    for path in sorted(held.glob("*.npy")):
        x = np.load(path)[None]
        reference = _run(source, x).astype(np.float64)
        candidate = _run(out, x)
        assert candidate.dtype == np.float16
        errors += float(np.sum((candidate.astype(np.float64) - reference) ** 2))
        signal += float(np.sum(reference**2))
    assert 10 * np.log10(signal / errors) > 30  # against the float16 model, on samples calibration never saw


def test_a_float16_decoder_quantizes_and_decodes(tmp_path):
    source = tmp_path / "decoder16.onnx"
    onnx.save(_to_float16(onnx.load(sample("decoder"))), source)
    out, config = tmp_path / "q.onnx", tmp_path / "c.yaml"
    config.write_text('exclude: ["/lm_head/MatMul"]\n')
    qtool.quantize(source, out, config_path=config, data_dir=calib_dir("decoder"), evaluation=None)
    written = onnx.load(out)
    caches = [v for v in [*written.graph.input, *written.graph.output] if "past" in v.name or "present" in v.name]
    assert len(caches) == 8 and all(v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in caches)
    head = next(init for init in written.graph.initializer if init.name.startswith("lm_head.weight"))
    assert head.name == "lm_head.weight/float16" and head.data_type == TensorProto.FLOAT16
    assert numpy_helper.to_array(head).shape == (128, 256)  # the 64 KiB table went through the detached store
    compared = qtool.compare(source, out, eval_dir("decoder"), options=qtool.EvaluationOptions(runs=0, limit=16))
    assert compared.language_model is not None and compared.language_model.ppl_ratio < 1.01
    assert compared.language_model.next_token_agreement > 0.9


def test_a_bfloat16_model_is_kept_float_with_one_line_for_all_its_nodes(tmp_path):
    # bfloat16 is not widened: each weighted node would stay float, and the summary says why once
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 8])
    y = helper.make_tensor_value_info("h4", TensorProto.BFLOAT16, [1, 8])
    weights = [helper.make_tensor(f"w{i}", TensorProto.BFLOAT16, [8, 8], [0.125] * 64) for i in range(5)]
    nodes = [
        helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}"], f"mm{i}") for i in range(5)
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], weights), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    path = tmp_path / "bf16.onnx"
    onnx.save(model, path)
    from typer.testing import CliRunner

    from qtool.cli import app

    result = CliRunner().invoke(app, ["inspect", str(path)])  # onnxruntime's CPU has no bfloat16 MatMul to run
    assert result.exit_code == 0, result.output
    reason = "an input is bfloat16, not float32"
    lines = [line for line in result.output.splitlines() if reason in line]
    assert len(lines) == 1 and "5 nodes (mm0, mm1, ...)" in lines[0], result.output
    assert not has_float16(model.graph)


def test_a_bfloat16_model_is_refused_in_one_line_before_any_sample_is_read(tmp_path: Path) -> None:
    import pytest
    from typer.testing import CliRunner

    from qtool.cli import app
    from qtool.errors import QtoolError

    weight = helper.make_tensor("w", TensorProto.BFLOAT16, [8, 8], np.zeros(64, np.uint16).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 8])],
        [weight],
    )
    model = tmp_path / "bf16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    out = tmp_path / "q.onnx"
    # before: each sample was refused ("expects bfloat16, got float32"), a type numpy cannot write
    r = CliRunner().invoke(app, ["quantize", str(model), "--data", str(tmp_path / "none"), "-o", str(out)])
    assert r.exit_code == 2 and "input 'x' is bfloat16" in r.stderr and "model.float()" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(QtoolError, match="bfloat16"):
        qtool.quantize(model, out)
