"""The options tune chooses between, built as quantize builds them, and what each is charged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qtool import api
from qtool.choice.tune.candidates import node_costs
from qtool.choice.tune.configs import allocation_document
from qtool.config import load_config
from qtool.options import EvaluationOptions
from tests.conftest import calib_dir, eval_dir, sample


def _built(tmp_path, option: str):
    document = allocation_document(load_config(None).raw, ["MatMul"], {"fc1/matmul": option})
    out = tmp_path / f"{option}.onnx"
    result = api.quantize(
        sample("mlp"),
        out,
        config_path=document,
        data_dir=calib_dir("mlp"),
        eval_dir=eval_dir("mlp"),
        evaluation=EvaluationOptions(runs=0),
    )
    model = onnx.load(out)
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "fc1.weight"]
    inits = {i.name: i for i in model.graph.initializer}
    return dq, numpy_helper.to_array(inits[dq.input[0]]), result.comparison.overall.sqnr_db


def test_w8bg_is_int8_in_blocks_of_32_rounded_by_gptq(tmp_path):
    dq, gptq, gptq_db = _built(tmp_path, "w8bg")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    assert gptq.dtype == np.int8 and attributes["block_size"] == 32
    _, nearest, nearest_db = _built(tmp_path, "w8b")
    # the same scales and format, other integers: GPTQ moved some weights off their nearest level,
    # for less output error on the held-out samples than rounding each weight to nearest
    assert gptq.shape == nearest.shape and 0 < np.count_nonzero(gptq != nearest) < gptq.size // 2
    assert gptq_db > nearest_db


def test_per_block_options_pay_a_scale_per_32_weights_along_the_reduction_axis():
    # a 1x1 convolution [64, 48, 1, 1]: 48 input channels make two blocks per output channel
    costs = node_costs(
        ["conv"],
        {"conv": [64, 48, 1, 1]},
        {"conv": 0},
        {"conv": 1},
        {},
        "size",
        ["w8", "w8g", "w8b", "w8bg", "w4", "fp16", "float"],
        lambda o: False,
    )["conv"]
    elements, scales = 64 * 48, 4.0
    assert costs["w8"] == costs["w8g"] == elements + scales * 64
    assert costs["w8b"] == costs["w8bg"] == elements + scales * 64 * 2
    assert costs["w4"] == elements / 2 + scales * 64 * 2
    assert costs["fp16"] == 2 * elements and costs["float"] == 4 * elements
    assert pytest.approx(costs["w8bg"] / costs["fp16"]) == (1 + 8 / 48) / 2
