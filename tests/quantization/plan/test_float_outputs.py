"""A small weighted node that feeds only the model's outputs writes a float output: no clipping to calibration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.quantization.plan import outputs
from qtool.quantization.plan.outputs import FLOAT_SHARE

INTEGER = Path(__file__).parents[3] / "configs" / "integer.yaml"


def _detector(head_channels: int = 4) -> onnx.ModelProto:
    """x [1, 8, 32, 32] -> Conv 8->64 -> Relu -> Conv 64->64 -> Relu -> two heads: boxes (1x1 Conv) and a feature.

    The ``feature`` output is also read by a Conv whose output is ``mixed``: it reaches another weighted node.
    """
    rng = np.random.default_rng(3)
    inits = {
        "w0": rng.normal(0, 0.15, (64, 8, 3, 3)),
        "b0": rng.normal(0, 0.1, 64),
        "w1": rng.normal(0, 0.05, (64, 64, 3, 3)),
        "b1": rng.normal(0, 0.1, 64),
        "wh": rng.normal(0, 0.3, (head_channels, 64, 1, 1)),
        "bh": rng.normal(0, 0.1, head_channels),
        "wf": rng.normal(0, 0.3, (4, 64, 1, 1)),
        "wm": rng.normal(0, 0.3, (4, 4, 1, 1)),
        "shape": np.array([1, head_channels, -1], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "wh", "bh"], ["head"], name="head"),
        helper.make_node("Reshape", ["head", "shape"], ["boxes"], name="boxes/reshape"),
        helper.make_node("Conv", ["r1", "wf"], ["feature"], name="feature"),
        helper.make_node("Conv", ["feature", "wm"], ["mixed"], name="mix"),
    ]
    graph = helper.make_graph(
        nodes,
        "heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 32, 32])],
        [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, head_channels, 1024]),
            helper.make_tensor_value_info("feature", TensorProto.FLOAT, [1, 4, 32, 32]),
            helper.make_tensor_value_info("mixed", TensorProto.FLOAT, [1, 4, 32, 32]),
        ],
        [
            numpy_helper.from_array(v.astype(np.float32 if v.dtype != np.int64 else np.int64), k)
            for k, v in inits.items()
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])


def _quantized(tmp_path: Path, model: onnx.ModelProto) -> tuple[Path, Path]:
    tmp_path.mkdir(exist_ok=True)
    source, data, out = tmp_path / "m.onnx", tmp_path / "calib", tmp_path / "q.onnx"
    onnx.save(model, source)
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(data / f"{i}.npy", rng.uniform(0, 1, (1, 8, 32, 32)).astype(np.float32))
    qtool.quantize(source, out, data_dir=data, config_path=INTEGER, search=None, evaluation=None)
    return source, out


def _producers(path: Path) -> dict[str, onnx.NodeProto]:
    return {o: n for n in onnx.load(path).graph.node for o in n.output}


def test_a_head_that_feeds_only_outputs_writes_a_float_output(tmp_path: Path, monkeypatch) -> None:
    source, out = _quantized(tmp_path / "float", _detector())
    producers = _producers(out)
    assert producers["head"].op_type == "Conv"  # the head's output is not quantized after it
    # an output also read by another weighted node keeps its quantized form (the next integer kernel reads it)
    assert producers["feature"].op_type == "DequantizeLinear"
    assert producers["mixed"].op_type == "Conv"  # the Conv reading it feeds an output only: float output too
    monkeypatch.setattr(outputs, "FLOAT_SHARE", 0.0)  # the same model with every output quantized
    _, quantized = _quantized(tmp_path / "int8", _detector())
    assert _producers(quantized)["head"].op_type == "DequantizeLinear"
    # on held-out inputs, some past the calibration range, the float head follows fp32 more closely: no rounding
    # after it, nothing clipped (the convolutions before it clip too, so the gain is small here)
    x = np.random.default_rng(9).uniform(0, 1.2, (16, 8, 32, 32)).astype(np.float32)
    assert _sqnr(source, out, x) > _sqnr(source, quantized, x) + 0.05


def _sqnr(reference: Path, candidate: Path, inputs: np.ndarray) -> float:
    run = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate)]
    ref, cand = (np.concatenate([s.run(["boxes"], {"x": x[None]})[0] for x in inputs]) for s in run)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - cand) ** 2)))


def test_a_final_node_doing_much_of_the_work_keeps_its_integer_output(tmp_path: Path) -> None:
    wide = 1024  # the head does more than FLOAT_SHARE of the multiply-accumulates
    model = _detector(head_channels=wide)
    head = wide * 64 * 1024
    assert head > FLOAT_SHARE * (head + 64 * 8 * 9 * 1024 + 64 * 64 * 9 * 1024)
    _, out = _quantized(tmp_path, model)
    assert _producers(out)["head"].op_type == "DequantizeLinear"  # its QLinearConv writes int8
