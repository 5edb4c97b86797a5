"""The output opset: bounded by the model, the config, onnxruntime's Q/DQ kernels and --opset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import QtoolError
from qtool.graph import opsets
from tests.graph.test_graph_coverage import FLOAT, _data, _normal, _save, _sqnr, _value, _weight

runner = CliRunner()
REAL_KERNEL_OPSET = opsets.qdq_kernel_opset


def _classifier(tmp_path: Path, opset: int, extra: list[onnx.NodeProto] | None = None) -> Path:
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "g"], ["y"], name="head", transB=1),
        *(extra or []),
    ]
    inputs = [_value("x", FLOAT, ["N", 3, 6, 6])]
    outputs = [_value("y", FLOAT, ["N", 5])]
    if extra:
        inputs.append(_value("bits", TensorProto.INT32, [4]))
        outputs.append(_value("flipped", TensorProto.INT32, [4]))
    inits = [_weight("w", 4, 3, 3, 3), _weight("b", 4), _weight("g", 5, 144, scale=0.1)]
    return _save(tmp_path, nodes, inputs, outputs, inits, opset=opset)


def _limit_runtime(monkeypatch: pytest.MonkeyPatch, newest: int) -> None:
    """Pretend onnxruntime has Q/DQ kernels only up to ``newest``, as 1.32 has up to 27 for opset-28 models."""

    def limited(dtype: str, *, quantize: bool) -> int | None:
        real = REAL_KERNEL_OPSET(dtype, quantize=quantize)
        return None if real is None else min(real, newest)

    monkeypatch.setattr(opsets, "qdq_kernel_opset", limited)


def _opset(path: Path) -> int:
    return next(o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx"))


def test_the_probe_finds_the_newest_opset_with_kernels_and_no_newer_one():
    newest = opsets.qdq_kernel_opset("uint8", quantize=True)
    assert newest is not None and newest >= 19

    def loads(opset: int) -> bool:
        scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.5])
        zero = helper.make_tensor("z", TensorProto.UINT8, [], [3])
        graph = helper.make_graph(
            [
                helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
            ],
            "g",
            [_value("x", FLOAT, [3])],
            [_value("y", FLOAT, [3])],
            [scale, zero],
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            ir_version=helper.find_min_ir_version_for([helper.make_opsetid("", opset)]),
        )
        options = ort.SessionOptions()
        options.log_severity_level = 4
        try:
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - onnxruntime's refusal of an opset or kernel is untyped
            return False
        y = session.run(None, {"x": np.array([0.0, 1.0, -1.0], np.float32)})[0]
        np.testing.assert_array_equal(y, [0.0, 1.0, -1.0])  # the kernel ran: a real round trip
        return True

    assert loads(newest)
    if newest < opsets.newest_onnx_opset():
        assert not loads(newest + 1)


def test_a_model_newer_than_the_runtimes_qdq_kernels_is_lowered_and_runs(tmp_path, monkeypatch):
    _limit_runtime(monkeypatch, 19)
    model = _classifier(tmp_path, 21)
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(1, 3, 6, 6)})
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=data, search=None, evaluation=None)
    assert (result.prepare.opset_before, result.prepare.opset_after) == (21, 19)
    assert _opset(out) == 19
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    assert _sqnr(model, out, feeds) > 25


def test_a_model_that_cannot_be_lowered_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch):
    _limit_runtime(monkeypatch, 17)
    model = _classifier(tmp_path, 18, [helper.make_node("BitwiseNot", ["bits"], ["flipped"], name="flip")])
    data, _ = _data(tmp_path, lambda i: {"x": _normal(1, 3, 6, 6), "bits": np.arange(4, dtype=np.int32)})
    out = tmp_path / "q.onnx"
    result = runner.invoke(app, ["quantize", str(model), "--data", str(data), "-o", str(out)])
    assert result.exit_code == 2, result.output
    first = result.output.strip().splitlines()[0]
    assert "opset 18" in first and "opset 17" in first and "BitwiseNot" in first
    assert "Traceback" not in result.output
    assert not out.exists()
    # calibrate refuses the same way, before reading any sample
    stats = tmp_path / "s.json"
    result = runner.invoke(app, ["calibrate", str(model), str(data), "-o", str(stats)])
    assert result.exit_code == 2 and "opset 18" in result.output and not stats.exists()


def test_opset_option_raises_the_output_opset(tmp_path):
    model = _classifier(tmp_path, 13)
    data, feeds = _data(tmp_path, lambda i: {"x": _normal(1, 3, 6, 6)})
    out = tmp_path / "q.onnx"
    result = runner.invoke(app, ["quantize", str(model), "--data", str(data), "-o", str(out), "--opset", "17"])
    assert result.exit_code == 0, result.output
    assert _opset(out) == 17
    assert _sqnr(model, out, feeds) > 25


@pytest.mark.parametrize(
    ("config", "opset", "message"),
    [
        ("global: {weight: {dtype: int4, granularity: per_block}}", 19, "below opset 21, which the config needs"),
        ("global: {placement: integer}", 11, "below opset 13, which the config needs (per-channel weights)"),
        ("global: {placement: integer}", 99, "above what the runtime can run"),
    ],
)
def test_opset_option_outside_what_the_config_and_runtime_allow_is_refused(tmp_path, config, opset, message):
    model = _classifier(tmp_path, 13)
    data, _ = _data(tmp_path, lambda i: {"x": _normal(1, 3, 6, 6)})
    config_path = tmp_path / "c.yaml"
    config_path.write_text(config + "\n")
    out = tmp_path / "q.onnx"
    args = ["quantize", str(model), "--data", str(data), "-o", str(out), "--config", str(config_path)]
    result = runner.invoke(app, [*args, "--opset", str(opset)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_a_config_needing_more_than_the_runtime_has_is_refused(tmp_path, monkeypatch):
    _limit_runtime(monkeypatch, 21)  # as an onnxruntime without INT2 kernels
    model = _classifier(tmp_path, 13)
    data, _ = _data(tmp_path, lambda i: {"x": _normal(1, 3, 6, 6)})
    config_path = tmp_path / "c.yaml"
    config_path.write_text("global: {weight: {dtype: int2, granularity: per_block}, weight_only: true}\n")
    with pytest.raises(QtoolError, match=r"config needs opset 25 \(int2 weights\).* only up to opset 21"):
        qtool.quantize(model, tmp_path / "q.onnx", data_dir=data, config_path=config_path, evaluation=None)
