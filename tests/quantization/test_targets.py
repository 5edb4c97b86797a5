"""``target: cpu|cuda|tensorrt``: the rules each target gets, checked on CPU, and TensorRT's calibration cache."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.calibration.tensorrt_cache import scale_hex, tensorrt_version_number
from qtool.errors import QtoolError
from tests.cli.test_cli import assert_user_error, invoke
from tests.conftest import calib_dir, sample


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_tensorrt_quantizes_every_layer_symmetric_int8_on_both_inputs(tmp_path):
    out = tmp_path / "trt.onnx"
    result = qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), target="tensorrt", evaluation=None)
    assert result.placements == {"integer": 4}  # no storage: a weight restored to float only costs time there
    assert set(result.kernels) == {"int8 Conv (TensorRT)", "int8 Gemm (TensorRT)"}
    model = onnx.load(out)
    inits, producers = _inits(model), _producers(model)
    quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert quantizers
    for q in quantizers:  # activations: int8 with zero point 0
        zero = inits[q.input[2]]
        assert zero.dtype == np.int8 and not zero.any()
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            data, weight = producers[node.input[0]], producers[node.input[1]]
            assert data.op_type == "DequantizeLinear" and weight.op_type == "DequantizeLinear"
            assert inits[weight.input[0]].dtype == np.int8  # full-range int8, not the CPU's uint8 guard
            assert not inits[weight.input[2]].any()


def test_tensorrt_gives_residual_add_inputs_qdq(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
            helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c2", "x"], ["y"], name="residual"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        [numpy_helper.from_array(w, "w1"), numpy_helper.from_array(w[::-1].copy(), "w2")],
    )
    model = tmp_path / "residual.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.normal(size=(8, 16, 16)).astype(np.float32))
    outputs = {}
    for target in ("cpu", "tensorrt"):
        out = tmp_path / f"{target}.onnx"
        qtool.quantize(model, out, data_dir=data, target=target, search=None, evaluation=None)
        written = onnx.load(out)
        producers = _producers(written)
        add = next(n for n in written.graph.node if n.name == "residual")
        outputs[target] = {producers[name].op_type for name in add.input if name in producers}
    assert outputs["tensorrt"] == {"DequantizeLinear"}  # both inputs, so TensorRT fuses the Add into conv2
    assert outputs["cpu"] != {"DequantizeLinear"}  # onnxruntime's CPU kernels gain nothing from it


def test_cuda_stores_weights_and_runs_float_while_tensorrt_refuses_what_it_cannot_run(tmp_path):
    result = qtool.quantize(
        sample("cnn"), tmp_path / "cuda.onnx", data_dir=calib_dir("cnn"), target="cuda", evaluation=None
    )
    assert result.placements == {"storage": 4} and result.placement_choice is None
    assert all(kernel.endswith("(CUDA)") for kernel in result.kernels)
    config = tmp_path / "dynamic.yaml"
    config.write_text("target: tensorrt\nop_type: {MatMul: {mode: dynamic}}\n")
    with pytest.raises(QtoolError, match=r"rule op_type:MatMul asks for mode: dynamic, which TensorRT does not run"):
        qtool.inspect(sample("transformer"), config_path=config)
    config.write_text("global: {weight: {format: matmul_nbits}}\n")
    with pytest.raises(QtoolError, match="MatMulNBits, which TensorRT does not run"):
        qtool.inspect(sample("transformer"), config_path=config, target="tensorrt")
    with pytest.raises(QtoolError, match="unknown target 'tpu'"):
        qtool.inspect(sample("transformer"), target="tpu")


def test_the_tensorrt_cache_holds_each_tensors_symmetric_int8_scale(tmp_path):
    stats, cache = tmp_path / "stats.json", tmp_path / "calib.cache"
    r = invoke(
        "calibrate",
        sample("cnn"),
        calib_dir("cnn"),
        "-o",
        stats,
        "--tensorrt-cache",
        cache,
        "--tensorrt-version",
        "8.6.1",
        "--observer",
        "minmax",
    )
    assert r.exit_code == 0, r.output
    lines = cache.read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    entries = dict(line.split(": ") for line in lines[1:])
    assert "input" in entries and len(entries) == len(lines) - 1 >= 5
    # The scale is the largest magnitude seen over 127: check the input's against the data itself.
    amax = max(float(np.abs(np.load(path)).max()) for path in sorted(calib_dir("cnn").glob("*.npy")))
    (scale,) = struct.unpack(">f", bytes.fromhex(entries["input"]))
    assert scale == pytest.approx(amax / 127, rel=1e-6)
    assert scale_hex(scale) == entries["input"] and len(entries["input"]) == 8
    assert tensorrt_version_number("10.3.0") == 100300


def test_a_malformed_tensorrt_version_is_refused_before_anything_is_written(tmp_path):
    stats, cache = tmp_path / "stats.json", tmp_path / "calib.cache"
    r = invoke(
        "calibrate",
        sample("cnn"),
        calib_dir("cnn"),
        "-o",
        stats,
        "--tensorrt-cache",
        cache,
        "--tensorrt-version",
        "ten",
    )
    assert_user_error(r, "TensorRT version 'ten' is not major.minor")
    assert not stats.exists() and not cache.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["CUDAExecutionProvider", "TensorrtExecutionProvider"])
def test_the_tensorrt_model_runs_on_the_gpu_providers(tmp_path, provider):
    if provider not in ort.get_available_providers():
        pytest.skip(f"{provider} is not available (needs an NVIDIA GPU and onnxruntime-gpu)")
    out = tmp_path / "trt.onnx"
    qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), target="tensorrt", evaluation=None)
    feed = {"input": np.load(sorted(calib_dir("cnn").glob("*.npy"))[0])[None]}
    session = ort.InferenceSession(str(out), providers=[provider, "CPUExecutionProvider"])
    reference = ort.InferenceSession(str(sample("cnn")), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = session.run(None, feed)[0]
    assert 10 * np.log10((reference**2).sum() / ((reference - got) ** 2).sum()) > 25
    assert Path(out).exists()


def test_required_providers_that_are_missing_fail_before_any_work(tmp_path):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: nothing is missing")
    report = tmp_path / "report.json"
    args = ("compare", sample("cnn"), sample("cnn"), "--data", calib_dir("cnn"), "--providers", "cpu,cuda")
    r = invoke(*args, "--require-providers", "--json", report)
    assert_user_error(r, "required execution provider CUDAExecutionProvider not available")
    assert not report.exists()
    assert invoke(*args, "--runs", "2", "--limit", "2").exit_code == 0  # without it, the CUDA row is a skip


def test_device_bound_runs_give_the_same_outputs_and_compare_reports_setup_apart(tmp_path):
    from qtool.evaluation.providers import session_providers
    from qtool.evaluation.timing import device_runner

    feed = {"input": np.load(sorted(calib_dir("cnn").glob("*.npy"))[0])[None]}
    session = ort.InferenceSession(str(sample("cnn")), providers=["CPUExecutionProvider"])
    runner = device_runner(session, feed, "cpu")  # the binding GPU providers use, on the CPU device
    assert runner is not None
    bound = runner()  # the binding, whose outputs stay on the device until copied
    np.testing.assert_array_equal(bound.copy_outputs_to_cpu()[0], session.run(None, feed)[0])
    assert device_runner(session, feed, "no-such-device") is None  # unavailable: plain runs instead
    assert session_providers("TensorrtExecutionProvider", "/engines") == [
        ("TensorrtExecutionProvider", {"trt_engine_cache_enable": "True", "trt_engine_cache_path": "/engines"}),
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    report, markdown = tmp_path / "report.json", tmp_path / "report.md"
    r = invoke(
        "compare",
        sample("cnn"),
        sample("cnn"),
        "--data",
        calib_dir("cnn"),
        "--limit",
        "2",
        "--runs",
        "3",
        "--json",
        report,
        "--markdown",
        markdown,
    )
    assert r.exit_code == 0, r.output
    latency = __import__("json").loads(report.read_text())["latency"][0]
    assert len(latency["setup_ms"]) == 2 and all(ms > 0 for ms in latency["setup_ms"])
    assert latency["io_binding"] is False  # CPU runs read host memory anyway
    assert "setup ms (ref / cand)" in markdown.read_text()


def test_accuracy_is_measured_again_on_each_gpu_provider(tmp_path, monkeypatch):
    from qtool.evaluation import compare as compare_module
    from qtool.evaluation.latency import latency_record
    from qtool.options import EvaluationOptions

    # Stand-in for a GPU: a session on the CPU under a GPU provider's name runs the plumbing for real.
    monkeypatch.setattr(compare_module, "session_providers", lambda name, cache=None: ["CPUExecutionProvider"])
    quantized = tmp_path / "q.onnx"
    qtool.quantize(sample("cnn"), quantized, data_dir=calib_dir("cnn"), search=None, evaluation=None)
    reference = ort.InferenceSession(str(sample("cnn")), providers=["CPUExecutionProvider"])
    times = ([1e-3] * 3, [1e-3] * 3)
    dataset = qtool.calibration.dataset.Dataset(
        calib_dir("cnn"), qtool.calibration.dataset.model_inputs(onnx.load(sample("cnn"))), limit=4
    )
    gpu = compare_module._provider_accuracy(
        latency_record("CUDAExecutionProvider", None, times),
        reference,
        quantized,
        dataset,
        None,
        EvaluationOptions(),
    )
    main = qtool.compare(sample("cnn"), quantized, calib_dir("cnn"), options=EvaluationOptions(runs=0, limit=4))
    assert gpu.candidate_sqnr_db == pytest.approx(min(o.sqnr_db for o in main.outputs), rel=1e-6)
    cpu = compare_module._provider_accuracy(
        latency_record("CPUExecutionProvider", None, times),
        reference,
        quantized,
        dataset,
        None,
        EvaluationOptions(),
    )
    assert cpu.candidate_sqnr_db is None  # the CPU's accuracy is the report's main table
