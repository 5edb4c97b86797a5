"""``--input-shapes``: dynamic dimensions fixed for qtool's work, the written model as general as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.errors import QtoolError
from qtool.graph.input_shapes import parse_input_shapes
from tests.cli.test_cli import assert_user_error, invoke


def _dynamic_conv(tmp_path):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 16, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32, "height", "width"])],
        [numpy_helper.from_array(rng.normal(0, 0.2, (32, 16, 3, 3)).astype(np.float32), "w")],
    )
    path = tmp_path / "dynamic.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.normal(size=(16, 64, 64)).astype(np.float32))
    return path, data


def test_fixed_shapes_size_the_tensors_without_data_and_the_output_stays_dynamic(tmp_path):
    model, data = _dynamic_conv(tmp_path)
    unsized = qtool.inspect(model).rows[0]
    assert "size unknown" in unsized.placement_reason
    sized = qtool.inspect(model, input_shapes={"image": (1, 16, 64, 64)}).rows[0]
    assert f"{64 * 64 * 32 * 16 * 9:,} MACs" in sized.placement_reason  # decided from the work it does
    out = tmp_path / "q.onnx"
    qtool.quantize(model, out, data_dir=data, input_shapes={"image": (1, 16, 64, 64)}, search=None, evaluation=None)
    dims = [d.dim_param or d.dim_value for d in onnx.load(out).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 16, "height", "width"]  # as general as the model it came from


def test_samples_of_another_shape_and_bad_specs_are_refused(tmp_path):
    model, data = _dynamic_conv(tmp_path)
    with pytest.raises(QtoolError, match="image"):
        qtool.calibrate(model, data, input_shapes={"image": (1, 16, 32, 32)})
    with pytest.raises(QtoolError, match="has no input 'images'"):
        qtool.inspect(model, input_shapes={"images": (1, 16, 64, 64)})
    with pytest.raises(QtoolError, match="has rank 4, not 3"):
        qtool.inspect(model, input_shapes={"image": (16, 64, 64)})
    with pytest.raises(QtoolError, match="has size 16 on axis 1, not 3"):
        qtool.inspect(model, input_shapes={"image": (1, 3, 64, 64)})
    assert parse_input_shapes("image:1x16x64x64, mask : 1X64") == {"image": (1, 16, 64, 64), "mask": (1, 64)}
    stats = tmp_path / "s.json"
    r = invoke("calibrate", model, data, "-o", stats, "--input-shapes", "image:1x16x0x64")
    assert_user_error(r, "--input-shapes entry 'image:1x16x0x64' is not name:AxBx... with positive sizes")
    assert not stats.exists()
    assert invoke("calibrate", model, data, "-o", stats, "--input-shapes", "image:1x16x64x64").exit_code == 0
