"""fp8 (E4M3) weights and activations: the sample models quantized with configs/fp8.yaml, read back from disk,
run by onnxruntime's CPU provider against fp32, and cross-checked with onnx's ReferenceEvaluator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

import qtool
from qtool.calibration.dataset import Dataset, model_inputs
from qtool.graph.ort_rewrites import RELU_QUANT_REWRITE, fp8_relu_quantizers
from tests.cli.test_cli import assert_user_error, invoke
from tests.conftest import ROOT, SAMPLE_NAMES, calib_dir, eval_dir, sample

FP8 = ROOT / "configs" / "fp8.yaml"
INT8_TENSORRT = {"version": 1, "target": "tensorrt"}  # the same target and placement, int8
# E4M3 keeps 3 mantissa bits: about 30 dB per rounding, less after several layers (int8: 31-41 dB here)
SQNR_FLOOR_DB = {"cnn": 16.0, "mlp": 26.0, "transformer": 28.0}


def _session(path: Path | str) -> ort.InferenceSession:
    """A plain onnxruntime CPU session, as a user would open the model (with the rewrite quantize's note names off)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=[RELU_QUANT_REWRITE]
    )


def _sqnr_db(name: str, candidate: Path) -> float:
    dataset = Dataset(eval_dir(name), model_inputs(onnx.load(str(sample(name)))))
    reference, quantized = _session(sample(name)), _session(candidate)
    signal = noise = 0.0
    for _, feed in dataset.samples():
        ref = reference.run(None, feed)[0].astype(np.float64)
        out = quantized.run(None, feed)[0].astype(np.float64)
        signal += float((ref**2).sum())
        noise += float(((ref - out) ** 2).sum())
    return 10 * np.log10(signal / noise)


@pytest.fixture(scope="module")
def fp8_samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Each sample model quantized with configs/fp8.yaml and, for comparison, with int8 for TensorRT."""
    out = tmp_path_factory.mktemp("fp8")
    built: dict[str, dict[str, Path]] = {}
    for name in SAMPLE_NAMES:
        built[name] = {}
        for kind, config in (("fp8", FP8), ("int8", INT8_TENSORRT)):
            target = out / f"{name}.{kind}.onnx"
            qtool.quantize(sample(name), target, data_dir=calib_dir(name), config_path=config, evaluation=None)
            built[name][kind] = target
    return built


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_fp8_samples_run_on_cpu_close_to_fp32_and_below_int8(name, fp8_samples):
    fp8, int8 = _sqnr_db(name, fp8_samples[name]["fp8"]), _sqnr_db(name, fp8_samples[name]["int8"])
    assert np.isfinite(fp8) and fp8 >= SQNR_FLOOR_DB[name], f"{name}: fp8 {fp8:.2f} dB"
    assert fp8 < int8 + 1.0, f"{name}: fp8 {fp8:.2f} dB, int8 {int8:.2f} dB"  # 3 mantissa bits vs 8 bits


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_fp8_weights_and_zero_points_are_float8_read_back_from_disk(name, fp8_samples):
    model = onnx.load(str(fp8_samples[name]["fp8"]))
    onnx.checker.check_model(model, full_check=True)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 19
    inits = {i.name: i for i in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    dequantizers = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert quantizers and dequantizers
    for node in quantizers + dequantizers:
        scale, zero = inits[node.input[1]], inits[node.input[2]]
        assert scale.data_type == TensorProto.FLOAT
        assert zero.data_type == TensorProto.FLOAT8E4M3FN
        assert not numpy_helper.to_array(zero).astype(np.float32).any()  # fp8 zeros
    for node in quantizers:  # activations: one scale per tensor
        assert numpy_helper.to_array(inits[node.input[1]]).size == 1
    weighted = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul") and n.input[1] in producer]
    for node in weighted:
        dq = producer[node.input[1]]
        if dq.input[0] not in inits:  # an activation (attention's MatMul of two tensors)
            continue
        stored = inits[dq.input[0]]
        assert stored.data_type == TensorProto.FLOAT8E4M3FN
        assert len(stored.raw_data) == int(np.prod(stored.dims))  # one byte per weight
        values = numpy_helper.to_array(stored).astype(np.float32)
        assert np.abs(values).max() == 448.0  # amax / 448: the largest weight takes the largest fp8 value
        if node.op_type == "Conv":  # per output channel
            axis = next(a.i for a in dq.attribute if a.name == "axis")
            assert axis == 0 and numpy_helper.to_array(inits[dq.input[1]]).shape == (stored.dims[0],)
        if len(node.input) > 2 and node.input[2]:  # the bias stays float, as TensorRT's fp8 layers add it
            assert node.input[2] in inits and inits[node.input[2]].data_type == TensorProto.FLOAT


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_onnxruntime_agrees_with_the_onnx_reference_evaluator_on_fp8_qdq(name, fp8_samples):
    path = fp8_samples[name]["fp8"]
    dataset = Dataset(eval_dir(name), model_inputs(onnx.load(str(sample(name)))))
    _, feed = next(iter(dataset.samples()))
    ours = _session(path).run(None, feed)[0]
    reference = ReferenceEvaluator(str(path)).run(None, feed)[0]
    # the same fp8 roundings; float sums in another order may move a value across a rounding boundary
    noise = float(((ours - reference).astype(np.float64) ** 2).sum())
    assert noise <= 1e-4 * float((reference.astype(np.float64) ** 2).sum()), (ours.ravel()[:5], reference.ravel()[:5])


def test_onnxruntime_relu_rewrite_is_the_reason_qtool_turns_it_off(fp8_samples):
    path = fp8_samples["cnn"]["fp8"]
    assert len(fp8_relu_quantizers(onnx.load(str(path)))) == 3  # Conv -> Relu -> QuantizeLinear, x3
    feed = {"input": np.load(sorted(eval_dir("cnn").glob("*.npy"))[0])[None].astype(np.float32)}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    plain = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    guarded = _session(path).run(None, feed)[0]
    reference = ReferenceEvaluator(str(path)).run(None, feed)[0]
    np.testing.assert_allclose(guarded, reference, rtol=1e-4, atol=1e-4)
    if np.allclose(plain, reference, rtol=1e-4, atol=1e-4):
        pytest.skip(f"onnxruntime {ort.__version__} keeps the Relu: the guard may go")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("global:\n  weight: {dtype: fp8_e4m3}\n  activation: {dtype: fp8_e4m3, symmetric: false}\n", ":3:44:"),
        ("target: tensorrt\nglobal:\n  weight: {dtype: fp8_e4m3, granularity: per_block}\n", ":3:42:"),
    ],
)
def test_a_config_asking_for_asymmetric_or_block_fp8_exits_2_naming_the_line(tmp_path, text, where):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    r = invoke("quantize", sample("mlp"), "--data", calib_dir("mlp"), "--config", config, "-o", tmp_path / "q.onnx")
    assert_user_error(r, f"{config}{where}", "fp8_e4m3")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.slow
def test_cli_quantize_inspect_and_compare_an_fp8_model(tmp_path):
    out = tmp_path / "cnn.fp8.onnx"
    r = invoke("quantize", sample("cnn"), "--config", "fp8", "--data", calib_dir("cnn"), "-o", out)
    assert r.exit_code == 0, r.stderr
    assert "3 fp8 Conv (TensorRT), 1 fp8 Gemm (TensorRT)" in r.stdout
    assert "disabled_optimizers=['ReluQuantRewrite']" in r.stdout.replace("\n", " ")
    r = invoke("inspect", sample("cnn"), "--config", "fp8", "--json", "-")
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["nodes"]
    assert {row["predicted_kernel"] for row in rows} == {"fp8 Conv (TensorRT)", "fp8 Gemm (TensorRT)"}
    r = invoke("inspect", sample("cnn"), "--target", "tensorrt", "--json", "-")
    int8 = {row["name"]: row["quantized_bytes"] for row in json.loads(r.stdout)["nodes"]}
    # 1 byte per weight, a float32 scale and a 1-byte zero point per channel: int8's size
    assert {row["name"]: row["quantized_bytes"] for row in rows} == int8
    r = invoke("compare", sample("cnn"), out, "--data", eval_dir("cnn"), "--runs", "0", "--json", "-")
    assert r.exit_code == 0, r.stderr
    sqnr = json.loads(r.stdout)["accuracy"]["overall"]["sqnr_db"]
    assert SQNR_FLOOR_DB["cnn"] <= sqnr < 60


def test_an_fp8_lookup_table_is_dequantized_before_the_gather(tmp_path):
    from onnx import helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["rows"], name="embed", axis=0),
            helper.make_node("MatMul", ["rows", "w"], ["y"], name="proj"),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [
            numpy_helper.from_array(rng.normal(size=(300, 16)).astype(np.float32), "table"),  # >= 4,096 values
            numpy_helper.from_array(rng.normal(size=(16, 8)).astype(np.float32), "w"),
        ],
    )
    model = tmp_path / "lookup.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.integers(0, 50, (4,)).astype(np.int64))
    out = tmp_path / "q.onnx"
    config = {"global": {"weight": {"dtype": "fp8_e4m3"}, "activation": {"dtype": "fp8_e4m3"}, "placement": "integer"}}
    result = qtool.quantize(model, out, data_dir=data, config_path=config, search=None, evaluation=None)
    assert result.placements == {"integer": 1, "weight_only": 1}
    written = onnx.load(str(out))
    producer = {o: n for n in written.graph.node for o in n.output}
    gather = next(n for n in written.graph.node if n.op_type == "Gather")
    assert producer[gather.input[0]].op_type == "DequantizeLinear"  # Gather reads no float8
    feed = {"ids": np.array([[0, 7, 49, 3]], np.int64)}
    fp32 = _session(model).run(None, feed)[0]
    quantized = _session(out).run(None, feed)[0]
    assert 10 * np.log10((fp32**2).sum() / ((fp32 - quantized) ** 2).sum()) > 20
