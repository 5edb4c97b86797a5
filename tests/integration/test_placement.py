"""placement: auto keeps small nodes' weights compressed but computed in float, so the default is never slower."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import qtool
from tests.conftest import ROOT, calib_dir, eval_dir, run_model, sample


def optimized_ops(path, tmp_path) -> collections.Counter:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_default_keeps_small_models_float_at_run_time_but_small_on_disk(tmp_path, name):
    out = tmp_path / f"{name}.onnx"
    result = qtool.quantize(sample(name), out, data_dir=calib_dir(name), evaluate=False)
    assert result.rewrite.quantized_weights and not result.rewrite.quantized_activations
    model = onnx.load(str(out))
    assert not [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    ops = optimized_ops(out, tmp_path)
    # the stored integers are restored to float once, at load: nothing of it runs per call
    assert not {"Cast", "DequantizeLinear", "QuantizeLinear"} & set(ops), ops
    assert sample(name).stat().st_size / out.stat().st_size > 3.3
    x = np.load(next(eval_dir(name).glob("*.npy")))[None]
    reference, candidate = run_model(sample(name), {"input": x})[0], run_model(out, {"input": x})[0]
    assert 10 * np.log10((reference**2).sum() / ((reference - candidate) ** 2).sum()) > 40


def test_default_runs_the_cnn_convolutions_as_integer_kernels_and_its_tiny_head_in_float(tmp_path):
    out = tmp_path / "cnn.onnx"
    qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), evaluate=False)
    ops = optimized_ops(out, tmp_path)
    assert ops["QLinearConv"] == 3 and ops["Conv"] == 0 and ops["QGemm"] == 0, ops
    inspection = qtool.inspect(sample("cnn"))
    placement = {r.name: (r.placement, r.reason) for r in inspection.rows}
    assert placement["block1/conv"] == ("integer", "auto: 4,718,592 MACs per sample")
    assert placement["head/gemm"][0] == "storage" and "1,280 MACs" in placement["head/gemm"][1]


def test_placement_can_be_forced_and_is_validated(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("global: {placement: storage}\n")
    out = tmp_path / "cnn.onnx"
    qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), config_path=config, evaluate=False)
    assert optimized_ops(out, tmp_path)["QLinearConv"] == 0
    out = tmp_path / "mlp.onnx"
    qtool.quantize(
        sample("mlp"), out, data_dir=calib_dir("mlp"), config_path=ROOT / "configs" / "integer.yaml", evaluate=False
    )
    assert optimized_ops(out, tmp_path)["QGemm"] == 3
    config.write_text("global: {placement: fastest}\n")
    with pytest.raises(qtool.QtoolError, match=r"c.yaml:1:21: global.placement: expected one of auto, integer"):
        qtool.load_config(config)
