"""Low-bit packed weights, block-wise scales, mixed precision and every shipped config."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.numerics.qparams import QUANT_TYPES, QParams, dequantize, to_tensor_proto
from tests.conftest import ROOT, SAMPLE_NAMES, calib_dir, eval_dir, run_model, sample

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def optimized_ops(path: Path, tmp_path: Path) -> collections.Counter:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int2", "uint2"])
def test_onnxruntime_dequantizes_our_packed_weights_exactly(dtype):
    """Packing is checked against onnxruntime's own DequantizeLinear, per axis and per block."""
    qtype = QUANT_TYPES[dtype]
    rng = np.random.default_rng(0)
    values = rng.integers(qtype.qmin, qtype.qmax + 1, size=(64, 5)).astype(qtype.numpy_dtype)
    opset = 25 if qtype.bits == 2 else 21
    for axis, block in ((1, None), (0, 16)):
        shape = (5,) if block is None else (4, 5)
        qp = QParams(
            rng.uniform(0.01, 0.1, shape).astype(np.float32),
            rng.integers(qtype.qmin, qtype.qmax + 1, shape).astype(qtype.numpy_dtype),
            qtype,
            axis,
            block,
        )
        attrs = {"axis": axis, **({"block_size": block} if block else {})}
        graph = helper.make_graph(
            [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)],
            "dq",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 5])],
            [
                to_tensor_proto(values, qtype, "q"),
                numpy_helper.from_array(qp.scale, "s"),
                to_tensor_proto(qp.zero_point, qtype, "z"),
            ],
        )
        opset_id = helper.make_opsetid("", opset)
        model = helper.make_model(
            graph, opset_imports=[opset_id], ir_version=helper.find_min_ir_version_for([opset_id])
        )
        onnx.checker.check_model(model, full_check=True)
        np.testing.assert_array_equal(run_model(model.SerializeToString(), {})[0], dequantize(values, qp))


def quantize_with(tmp_path: Path, name: str, config: str) -> Path:
    """Quantize with the config's placement rules (no measured choice, which could pick storage)."""
    out = tmp_path / f"{name}.onnx"
    qtool.quantize(
        sample(name),
        out,
        data_dir=calib_dir(name),
        config_path=write_config(tmp_path, config),
        search=None,
        evaluation=None,
    )
    return out


def test_int4_per_channel_compresses_the_mlp_at_least_6_5x(tmp_path):
    out = quantize_with(tmp_path, "mlp", "global: {weight: {dtype: int4}}\n")
    model = onnx.load(str(out))
    assert {i.data_type for i in model.graph.initializer if i.name.endswith("weight/quantized")} == {TensorProto.INT4}
    assert model.opset_import[0].version >= 21 and model.ir_version >= 10
    onnx.checker.check_model(model, full_check=True)
    assert sample("mlp").stat().st_size / out.stat().st_size >= 6.5


def test_int2_compresses_the_mlp_at_least_11x(tmp_path):
    out = quantize_with(tmp_path, "mlp", "global: {weight: {dtype: int2}}\n")
    model = onnx.load(str(out))
    assert {i.data_type for i in model.graph.initializer if i.name.endswith("weight/quantized")} == {TensorProto.INT2}
    assert model.opset_import[0].version >= 25
    run_model(out, {"input": np.load(next(eval_dir("mlp").glob("*.npy")))[None]})
    assert sample("mlp").stat().st_size / out.stat().st_size >= 11


def test_int4_blocks_of_32_become_matmulnbits(tmp_path):
    out = quantize_with(tmp_path, "transformer", (ROOT / "configs" / "int4_blockwise.yaml").read_text())
    dq = [n for n in onnx.load(str(out)).graph.node if n.op_type == "DequantizeLinear"]
    assert all({a.name: a.i for a in n.attribute}.get("block_size") == 32 for n in dq)
    ops = optimized_ops(out, tmp_path)
    assert ops["MatMulNBits"] == 6, ops  # the six weight MatMuls; the two attention MatMuls have no weight
    assert ops["DequantizeLinear"] == 0, ops


def test_block_scales_follow_the_reduction_axis_of_each_op(tmp_path):
    out = quantize_with(tmp_path, "cnn", "global: {weight: {dtype: int4, granularity: per_block, block_size: 16}}\n")
    model = onnx.load(str(out))
    inits = {i.name: i for i in model.graph.initializer}
    for node in (n for n in model.graph.node if n.op_type == "DequantizeLinear"):
        stored, scale = inits[node.input[0]], inits[node.input[1]]
        attrs = {a.name: a.i for a in node.attribute}
        assert attrs["block_size"] == 16 and attrs["axis"] == 1  # Conv: input channels; Gemm(transB): K
        expected = list(stored.dims)
        expected[1] = -(-expected[1] // 16)
        assert list(scale.dims) == expected


def test_mixed_config_assigns_exactly_what_it_says(tmp_path):
    mixed = (ROOT / "configs" / "mixed.yaml").read_text()
    for name, float_node in (("cnn", "head/gemm"), ("mlp", "fc2/matmul")):
        out = quantize_with(tmp_path, name, mixed)
        model = onnx.load(str(out))
        inits = {i.name: i for i in model.graph.initializer}
        producer = {o: n for n in model.graph.node for o in n.output}
        for node in model.graph.node:
            if node.op_type not in ("Conv", "MatMul", "Gemm"):
                continue
            weight_dq = producer.get(node.input[1])
            if node.name == float_node:
                assert weight_dq is None, f"{name}: {node.name} should read its float weight"
                assert inits[node.input[1]].data_type == TensorProto.FLOAT
                continue
            stored = inits[weight_dq.input[0]]
            attrs = {a.name: a.i for a in weight_dq.attribute}
            if node.op_type == "Conv":
                assert stored.data_type == TensorProto.INT8 and attrs == {"axis": 0}  # weight.saturation: auto
                assert producer[node.input[0]].op_type == "DequantizeLinear"  # int8 activations too
            else:
                assert stored.data_type == TensorProto.INT4 and attrs == {"axis": 0, "block_size": 32}
                assert node.input[0] not in producer or producer[node.input[0]].op_type != "DequantizeLinear"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_quantizes_every_sample_and_runs(tmp_path, config):
    for name in SAMPLE_NAMES:
        out = tmp_path / f"{name}.onnx"
        result = qtool.quantize(sample(name), out, data_dir=calib_dir(name), config_path=config, evaluation=None)
        assert result.rewrite.quantized_nodes
        onnx.checker.check_model(onnx.load(str(out)), full_check=True)
        x = np.load(next(eval_dir(name).glob("*.npy")))[None]
        reference, candidate = run_model(sample(name), {"input": x})[0], run_model(out, {"input": x})[0]
        assert candidate.shape == reference.shape and np.all(np.isfinite(candidate))


def test_inspect_predicts_the_real_size_and_lists_rules_and_float_nodes(tmp_path):
    config = write_config(tmp_path, (ROOT / "configs" / "mixed.yaml").read_text())
    result = qtool.inspect(sample("mlp"), config_path=config)
    rows = {r.name: r for r in result.rows}
    assert rows["fc0/matmul"].rule == "op_type:MatMul" and rows["fc0/matmul"].weight == "int4 per_block(32) sym"
    assert rows["fc0/matmul"].activation == "float"
    assert [(n, op) for n, op, _ in result.kept_float] == [("fc2/matmul", "MatMul")]
    assert "exclude:re:(head|fc2)/.*" in result.kept_float[0][2]
    assert result.passthrough == {"Add": 3, "Relu": 2}
    out = quantize_with(tmp_path, "mlp", config.read_text())
    assert result.predicted_bytes == pytest.approx(out.stat().st_size, rel=0.002)


def test_weight_axis_out_of_range_is_a_clear_error(tmp_path):
    config = write_config(tmp_path, "op_type: {Gemm: {weight: {axis: 5}}}\n")
    with pytest.raises(qtool.QtoolError, match=r"head/gemm: weight axis 5 is out of range"):
        qtool.quantize(sample("cnn"), tmp_path / "o.onnx", data_dir=calib_dir("cnn"), config_path=config)
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_narrow_per_channel_weights_run_in_int8_kernels_with_quantized_activations(tmp_path, dtype):
    """The packed weight is widened by a Cast that onnxruntime folds, so QLinearConv/QGemm still run."""
    out = quantize_with(tmp_path, "cnn", f"global: {{weight: {{dtype: {dtype}}}, placement: integer}}\n")
    model = onnx.load(str(out))
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) == 4 and all({a.name: a.i for a in n.attribute}["to"] == TensorProto.INT8 for n in casts)
    ops = optimized_ops(out, tmp_path)
    assert ops["QLinearConv"] == 3 and ops["QGemm"] == 1 and ops["Conv"] == 0 and ops["Cast"] == 0, ops


def _weight_zero_points(path: Path) -> dict[str, bool]:
    """Each weight DequantizeLinear (integer input stored in the file) -> whether it has a zero point."""
    model = onnx.load(str(path))
    stored = {i.name for i in model.graph.initializer}
    widened = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    return {
        n.name: len(n.input) > 2 and bool(n.input[2])
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and widened.get(n.input[0], n.input[0]) in stored
    }


def test_symmetric_stored_weights_write_no_zero_point_and_integer_kernels_keep_theirs(tmp_path):
    weight_only = tmp_path / "weight_only"
    weight_only.mkdir()
    config = "global: {weight: {dtype: int4, granularity: per_block, block_size: 32}, weight_only: true}\n"
    out = quantize_with(weight_only, "mlp", config)
    flags = _weight_zero_points(out)
    assert flags and not any(flags.values())  # all zeros, the operator's default: not stored once per block
    model = onnx.load(str(out))
    assert not [i.name for i in model.graph.initializer if i.name.endswith("zero_point")]
    feed = {"input": np.load(sorted(eval_dir("mlp").glob("*.npy"))[0])}
    feed = {k: v if v.ndim == 2 else v[None] for k, v in feed.items()}
    reference, got = run_model(sample("mlp"), feed)[0], run_model(out, feed)[0]
    assert 10 * np.log10((reference**2).sum() / ((reference - got) ** 2).sum()) > 15
    integer = tmp_path / "integer"
    integer.mkdir()
    flags = _weight_zero_points(quantize_with(integer, "cnn", "global: {placement: integer}\n"))
    assert flags and all(flags.values())  # onnxruntime's QGemm fusion wants the weight's zero point
    asymmetric = tmp_path / "asymmetric"
    asymmetric.mkdir()
    config = "global: {weight: {dtype: int4, granularity: per_block, symmetric: false}, weight_only: true}\n"
    assert all(_weight_zero_points(quantize_with(asymmetric, "mlp", config)).values())
