"""Sample model -> quantize -> checker -> onnxruntime -> close to fp32."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import qtool
from qtool.calibration.dataset import Dataset, model_inputs
from qtool.numerics.saturation import CONV, ROWS, overflowing_columns
from qtool.options import CalibrationOptions, EvaluationOptions
from tests.conftest import INTEGER, SAMPLE_NAMES, calib_dir, eval_dir, run_model, sample

SQNR_FLOOR_DB = {"cnn": 30.0, "mlp": 30.0, "transformer": 25.0}
QUANTIZABLE = {"Conv", "MatMul", "Gemm"}


def _sqnr_db(name: str, candidate) -> float:
    model = onnx.load(str(sample(name)))
    dataset = Dataset(eval_dir(name), model_inputs(model))
    signal = noise = 0.0
    for _, feed in dataset.samples():
        ref = run_model(sample(name), feed)[0].astype(np.float64)
        cand = run_model(candidate, feed)[0].astype(np.float64)
        signal += float((ref**2).sum())
        noise += float(((ref - cand) ** 2).sum())
    return 10 * np.log10(signal / noise)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_quantized_sample_is_close_to_fp32_on_evaluation_data(name, quantized_samples):
    sqnr = _sqnr_db(name, quantized_samples[name])
    assert sqnr >= SQNR_FLOOR_DB[name], f"{name}: SQNR {sqnr:.2f} dB"


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_quantized_model_passes_full_check_and_keeps_graph_io(name, quantized_samples):
    original = onnx.load(str(sample(name)))
    quantized = onnx.load(str(quantized_samples[name]))
    onnx.checker.check_model(quantized, full_check=True)
    assert [i.SerializeToString() for i in quantized.graph.input] == [
        i.SerializeToString() for i in original.graph.input
    ]
    assert [o.name for o in quantized.graph.output] == [o.name for o in original.graph.output]
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in quantized.graph.output)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_every_quantizable_node_reads_dequantized_activations_and_weights(name, quantized_samples):
    model = onnx.load(str(quantized_samples[name]))
    producer = {o: n for n in model.graph.node for o in n.output}
    nodes = [n for n in model.graph.node if n.op_type in QUANTIZABLE]
    assert nodes
    for node in nodes:
        for tensor in node.input[:2]:
            assert producer[tensor].op_type == "DequantizeLinear", f"{node.name} reads {tensor} unquantized"
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 2:
            bias_dq = producer[node.input[2]]
            stored = {i.name: i for i in model.graph.initializer}[bias_dq.input[0]]
            assert stored.data_type == onnx.TensorProto.INT32
    # one shared Q/DQ pair per tensor, not one per consumer
    quantized_inputs = [n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantized_inputs) == len(set(quantized_inputs))


def test_weights_are_8_bit_per_channel_along_the_output_axis(quantized_samples):
    model = onnx.load(str(quantized_samples["cnn"]))
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm"):
            continue
        dq = producer[node.input[1]]
        weight = numpy_helper.to_array(inits[dq.input[0]])
        scale = numpy_helper.to_array(inits[dq.input[1]])
        zero = numpy_helper.to_array(inits[dq.input[2]])
        axis = {a.name: a.i for a in dq.attribute}.get("axis", 1)
        # int8 weights whose adjacent pairs cannot saturate uint8 x int8 kernels without VNNI (weight.saturation:
        # auto), so that onnxruntime's integer kernels are exact on every x86 CPU
        assert weight.dtype == np.int8 and np.all(zero == 0)
        assert overflowing_columns(weight, CONV if node.op_type == "Conv" else ROWS) == 0
        assert axis == 0  # Conv output channels; the sample's Gemm has transB=1, so rows are outputs
        assert scale.shape == (weight.shape[0],)
        # symmetric: each channel uses its extreme, or at least half of it where its pairs were fitted
        extremes = np.abs(weight.reshape(weight.shape[0], -1).astype(np.int16)).max(axis=1)
        assert extremes.max() <= 127 and extremes.min() >= 64


def test_weight_dequantize_matches_onnx_reference_evaluator(quantized_samples):
    """Cross-check our stored weights with onnx's own DequantizeLinear implementation."""
    original = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(sample("mlp"))).graph.initializer}
    model = onnx.load(str(quantized_samples["mlp"]))
    inits = {i.name: i for i in model.graph.initializer}
    checked = 0
    for dq in (n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in original):
        graph = onnx.helper.make_graph(
            [dq],
            "dq",
            [],
            [onnx.helper.make_tensor_value_info(dq.output[0], 1, None)],
            [inits[name] for name in dq.input],
        )
        ref = ReferenceEvaluator(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)]))
        restored = ref.run(None, {})[0]
        scale = numpy_helper.to_array(inits[dq.input[1]])
        axis = {a.name: a.i for a in dq.attribute}.get("axis", 1)
        shape = [1] * restored.ndim
        shape[axis] = -1
        stored = numpy_helper.to_array(inits[dq.input[0]]).astype(np.float32)
        zero = numpy_helper.to_array(inits[dq.input[2]]).astype(np.float32).reshape(shape)
        np.testing.assert_array_equal(restored, (stored - zero) * scale.reshape(shape))  # the spec's arithmetic
        # rounded to nearest, but for the few codes that gave way to keep int8 pairs from saturating
        within = np.abs(restored - original[dq.output[0]]) <= scale.reshape(shape) / 2 + 1e-6
        assert within.mean() > 0.99, within.mean()
        checked += 1
    assert checked == 3


FLOAT_KERNELS = {"Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm"}


def _optimized_ops(path, tmp_path) -> collections.Counter:
    optimized = tmp_path / "optimized.onnx"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)


def test_onnxruntime_runs_the_cnn_with_integer_kernels(quantized_samples, tmp_path):
    ops = _optimized_ops(quantized_samples["cnn"], tmp_path)
    assert not FLOAT_KERNELS & set(ops), ops
    assert ops["QLinearConv"] == 3 and ops["QGemm"] == 1, ops


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_onnxruntime_runs_every_matmul_with_integer_kernels(name, quantized_samples, tmp_path):
    ops = _optimized_ops(quantized_samples[name], tmp_path)
    assert not FLOAT_KERNELS & set(ops), ops
    integer = ops["QGemm"] + ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"]
    original = collections.Counter(n.op_type for n in onnx.load(str(sample(name))).graph.node)
    assert integer == original["MatMul"], ops


def test_matmul_output_is_quantized_after_its_bias_not_before(quantized_samples):
    """Rounding the raw MatMul output and again after the bias would add error for nothing."""
    model = onnx.load(str(quantized_samples["mlp"]))
    quantized = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert not any("matmul_out" in t for t in quantized), quantized
    assert "fc0/relu_out/float" in quantized  # past the bias Add and the Relu


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_weight_dominated_samples_compress_at_least_3_5x(name, quantized_samples):
    ratio = sample(name).stat().st_size / quantized_samples[name].stat().st_size
    assert ratio >= 3.5, ratio


def test_quantizing_twice_gives_byte_identical_files(tmp_path, quantized_samples):
    again = tmp_path / "again.onnx"
    qtool.quantize(
        sample("transformer"), again, data_dir=calib_dir("transformer"), config_path=INTEGER, evaluation=None
    )
    assert again.read_bytes() == quantized_samples["transformer"].read_bytes()


def test_calibrate_then_quantize_equals_quantize_with_data(tmp_path, quantized_samples):
    stats_path = tmp_path / "cnn.stats.json"
    stats = qtool.calibrate(sample("cnn"), calib_dir("cnn"), config_path=INTEGER)
    qtool.write_stats(stats, stats_path)
    reread = qtool.CalibrationStats.read(stats_path)
    assert reread.to_json() == stats.to_json() and reread.samples == 64
    out = tmp_path / "cnn.onnx"
    # the same samples for the measured choice (its activation ranges): what --stats with --search-data does
    search = qtool.SearchOptions(data_dir=calib_dir("cnn"))
    qtool.quantize(sample("cnn"), out, stats_path=stats_path, config_path=INTEGER, search=search, evaluation=None)
    assert out.read_bytes() == quantized_samples["cnn"].read_bytes()


def test_stats_of_two_shards_merge_to_the_stats_of_the_whole(tmp_path):
    import shutil

    shards = [tmp_path / "a", tmp_path / "b"]
    for shard in shards:
        shard.mkdir()
    for i, f in enumerate(sorted(calib_dir("mlp").glob("*.npy"))):
        shutil.copy(f, shards[i % 2])
    whole = qtool.calibrate(sample("mlp"), calib_dir("mlp"))
    merged = qtool.calibrate(sample("mlp"), shards[0]).merge(qtool.calibrate(sample("mlp"), shards[1]))
    assert merged.to_json() == whole.to_json()


def test_compare_reports_the_numbers_it_measures(quantized_samples):
    result = qtool.compare(
        sample("mlp"), quantized_samples["mlp"], eval_dir("mlp"), options=EvaluationOptions(runs=5, warmup=1)
    )
    assert result.samples == 32
    assert result.compression_ratio == pytest.approx(
        sample("mlp").stat().st_size / quantized_samples["mlp"].stat().st_size
    )
    assert result.overall.sqnr_db == pytest.approx(_sqnr_db("mlp", quantized_samples["mlp"]), abs=1e-6)
    assert 0.99 < result.overall.cosine <= 1.0
    lat = result.primary_latency
    assert lat is not None and lat.reference.runs == 5 and lat.provider == "CPUExecutionProvider"
    assert lat.reference.median_ms <= lat.reference.p90_ms <= lat.reference.p99_ms
    # the speed-up is the median of the rounds' own ratios (both models ran in each), inside its interval
    assert lat.latency_ratio is not None and lat.speedup == pytest.approx(1 / lat.latency_ratio)
    assert lat.speedup_interval is None  # 5 rounds: too few for a 99 % interval (8 are needed)


def test_comparing_a_model_with_itself_is_exact():
    result = qtool.compare(sample("cnn"), sample("cnn"), eval_dir("cnn"), options=EvaluationOptions(runs=0, limit=4))
    assert result.overall.mse == 0.0 and result.overall.sqnr_db == float("inf") and result.latency == []


def test_batched_calibration_gives_the_same_ranges_as_one_by_one():
    one = qtool.calibrate(sample("transformer"), calib_dir("transformer"), options=CalibrationOptions(batch_size=1))
    batched = qtool.calibrate(
        sample("transformer"), calib_dir("transformer"), options=CalibrationOptions(batch_size=16)
    )
    for name, obs in one.tensors.items():
        lo1, hi1 = obs.range(8, False)
        lo2, hi2 = batched.tensors[name].range(8, False)
        np.testing.assert_allclose([lo1, hi1], [lo2, hi2], rtol=1e-5, atol=1e-6)
