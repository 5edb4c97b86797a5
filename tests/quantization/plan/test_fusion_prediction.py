"""qtool's prediction of onnxruntime's kernels against the optimized graph onnxruntime writes."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.quantization.plan.kernels import WEIGHTED_INTEGER_KERNELS
from qtool.quantization.plan.roles import FUSED_KERNELS
from tests.conftest import ROOT, calib_dir, sample

INTEGER_KERNELS = WEIGHTED_INTEGER_KERNELS | set(FUSED_KERNELS.values())


def actual_kernels(path, tmp_path) -> collections.Counter:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    return collections.Counter({k: v for k, v in ops.items() if k in INTEGER_KERNELS})


CASES = [
    ("cnn", "integer.yaml"),
    ("mlp", "integer.yaml"),
    ("transformer", "integer.yaml"),
    ("cnn", "default.yaml"),
    ("mlp", "default.yaml"),
    ("transformer", "int4_blockwise.yaml"),
    ("mlp", "int4_blockwise.yaml"),
    ("cnn", "w8a16.yaml"),
    ("cnn", "int2.yaml"),
]


@pytest.mark.parametrize(("name", "config"), CASES, ids=[f"{n}-{c.removesuffix('.yaml')}" for n, c in CASES])
def test_predicted_integer_kernels_match_onnxruntime(tmp_path, name, config):
    out = tmp_path / "q.onnx"
    config_path = ROOT / "configs" / config
    # no sensitivity search: inspect predicts the placement the config and the tensor sizes decide
    result = qtool.quantize(
        sample(name), out, data_dir=calib_dir(name), config_path=config_path, search=None, evaluation=None
    )
    # with samples, inspect shows the rules' guess (what --no-search writes); without, what quantize writes then
    inspection = qtool.inspect(sample(name), config_path=ROOT / "configs" / config, data_dir=calib_dir(name))
    # a pass-through op ("int8 MaxPool") keeps its own op type on 8-bit values: counted by test_chains.py
    predicted = collections.Counter(
        r.predicted_kernel for r in inspection.rows if not r.predicted_kernel.startswith(("float", "int8 "))
    )
    # inspect decides placement from static shapes, quantize from the calibration data: they must agree
    assert dict(collections.Counter(r.placement for r in inspection.rows)) == result.placements
    assert predicted == actual_kernels(out, tmp_path)


def test_a_matmul_chain_predicts_qlinearmatmul_inside_and_a_float_output_at_its_end(tmp_path):
    # x -> MatMul -> Relu -> MatMul -> Sigmoid -> MatMul (8 outputs: under 2 % of the work) -> y
    rng = np.random.default_rng(0)
    shapes = {"w0": (256, 1024), "w1": (1024, 1024), "w2": (1024, 8)}
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
        helper.make_node("Relu", ["a"], ["ar"], name="relu"),
        helper.make_node("MatMul", ["ar", "w1"], ["b"], name="mm1"),
        helper.make_node("Sigmoid", ["b"], ["bs"], name="sigmoid"),
        helper.make_node("MatMul", ["bs", "w2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 8])],
        [numpy_helper.from_array(rng.normal(0, 0.1, s).astype(np.float32), n) for n, s in shapes.items()],
    )
    source, data, out = tmp_path / "m.onnx", tmp_path / "calib", tmp_path / "q.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)]), source)
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i}.npy", rng.normal(0, 1, (16, 256)).astype(np.float32))
    qtool.quantize(
        source, out, data_dir=data, config_path=ROOT / "configs" / "integer.yaml", search=None, evaluation=None
    )
    inspection = qtool.inspect(source, config_path=ROOT / "configs" / "integer.yaml", data_dir=data)
    predicted = collections.Counter(
        r.predicted_kernel for r in inspection.rows if not r.predicted_kernel.startswith(("float", "int8 "))
    )
    assert predicted == actual_kernels(out, tmp_path)
    assert predicted["QLinearMatMul"] == 2 and predicted["MatMulIntegerToFloat"] == 1  # the last writes float
