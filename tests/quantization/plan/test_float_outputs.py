"""An integer Gemm or MatMul that feeds only the model's outputs writes a float output: no clipping to calibration."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.quantization.plan import planner
from tests.quantization.plan.test_fusion_prediction import INTEGER_KERNELS, actual_kernels

INTEGER = Path(__file__).parents[3] / "configs" / "integer.yaml"


def _heads() -> onnx.ModelProto:
    """x [1, 8, 16, 16] -> Conv -> Relu -> three heads.

    ``scores``: pooled, flattened, a Gemm with a bias; ``value``: a MatMul of the same features; ``mask``: a 1x1 Conv
    of the feature map; ``biased``: a MatMul and a bias Add (onnxruntime fuses them into a Gemm).
    """
    rng = np.random.default_rng(3)
    inits = {
        "w0": rng.normal(0, 0.3, (32, 8, 3, 3)),
        "b0": rng.normal(0, 0.1, 32),
        "wg": rng.normal(0, 0.3, (4, 32)),
        "bg": rng.normal(0, 0.1, 4),
        "wv": rng.normal(0, 0.3, (32, 2)),
        "wm": rng.normal(0, 0.3, (2, 32, 1, 1)),
        "wb": rng.normal(0, 0.3, (32, 3)),
        "bb": rng.normal(0, 0.1, 3),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("GlobalAveragePool", ["r0"], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["features"], name="flatten"),
        helper.make_node("Gemm", ["features", "wg", "bg"], ["scores"], name="gemm", transB=1),
        helper.make_node("MatMul", ["features", "wv"], ["value"], name="matmul"),
        helper.make_node("Conv", ["r0", "wm"], ["mask"], name="mask"),
        helper.make_node("MatMul", ["features", "wb"], ["product"], name="biased"),
        helper.make_node("Add", ["product", "bb"], ["biased_out"], name="bias"),
    ]
    outputs = {"scores": [1, 4], "value": [1, 2], "mask": [1, 2, 16, 16], "biased_out": [1, 3]}
    graph = helper.make_graph(
        nodes,
        "heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs.items()],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])


def _quantized(folder: Path) -> tuple[Path, Path, dict[str, int]]:
    folder.mkdir()
    source, data, out = folder / "m.onnx", folder / "calib", folder / "q.onnx"
    onnx.save(_heads(), source)
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(data / f"{i}.npy", rng.uniform(0, 1, (1, 8, 16, 16)).astype(np.float32))
    result = qtool.quantize(source, out, data_dir=data, config_path=INTEGER, search=None, evaluation=None)
    return source, out, result.kernels


def _producers(path: Path) -> dict[str, str]:
    return {o: n.op_type for n in onnx.load(path).graph.node for o in n.output}


def test_integer_heads_that_feed_only_outputs_write_float_outputs_and_keep_their_kernels(tmp_path, monkeypatch):
    source, out, kernels = _quantized(tmp_path / "float")
    producers = _producers(out)
    assert producers["scores"] == "Gemm" and producers["value"] == "MatMul"  # no QuantizeLinear after them
    # a Conv (no integer kernel with a float output) and a MatMul + bias Add (fused into a float Gemm) keep theirs
    assert producers["mask"] == "DequantizeLinear" and producers["biased_out"] == "DequantizeLinear"
    # onnxruntime runs the float-output heads on integer kernels, as predicted
    assert kernels["QGemm"] == 2 and kernels["MatMulIntegerToFloat"] == 1  # the Gemm and the fused MatMul + Add
    predicted = collections.Counter({k: v for k, v in kernels.items() if k in INTEGER_KERNELS})
    assert predicted == actual_kernels(out, tmp_path)
    monkeypatch.setattr(planner, "writes_float_output", lambda *args: False)  # every output quantized
    _, quantized, _ = _quantized(tmp_path / "int8")
    assert _producers(quantized)["scores"] == "DequantizeLinear"
    # held-out inputs, some past the calibration range: the float heads follow fp32 more closely
    x = np.random.default_rng(9).uniform(0, 1.3, (16, 1, 8, 16, 16)).astype(np.float32)
    for output in ("scores", "value"):
        assert _sqnr(source, out, x, output) > _sqnr(source, quantized, x, output) + 0.05


def _sqnr(reference: Path, candidate: Path, inputs: np.ndarray, output: str) -> float:
    run = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate)]
    ref, cand = (np.concatenate([s.run([output], {"x": x})[0] for x in inputs]) for s in run)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - cand) ** 2)))
