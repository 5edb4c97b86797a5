"""Nothing stored twice: a weight read by several nodes is quantized and stored once, whatever placement each
reader gets, and a weight that only Shape nodes read is not kept at all."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import qtool
from tests.conftest import run_model
from tests.graph.test_prepare import tf2onnx_shapes_model

KERNEL = (64, 64, 3, 3)


def _shared_kernel_model(directory: Path, *, shared: bool = True) -> Path:
    """One 64x64x3x3 kernel read by six Convs: three on 32x32 (37.7 M MACs each), three on 2x2 (147 k MACs).

    ``shared=False`` gives each Conv its own initializer with the same values.
    """
    rng = np.random.default_rng(0)
    kernel = rng.normal(0, 0.05, KERNEL).astype(np.float32)
    names = ["w"] if shared else [f"w{i}" for i in range(6)]
    nodes, current = [], "x"
    for i in range(3):
        weight = names[i % len(names)]
        nodes.append(helper.make_node("Conv", [current, weight], [f"c{i}"], name=f"big{i}", pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        current = f"r{i}"
    nodes.append(helper.make_node("MaxPool", [current], ["p"], kernel_shape=[16, 16], strides=[16, 16]))
    current = "p"
    for i in range(3):
        weight = names[(3 + i) % len(names)]
        nodes.append(helper.make_node("Conv", [current, weight], [f"s{i}"], name=f"small{i}", pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Tanh", [f"s{i}"], [f"t{i}"]))
        current = f"t{i}"
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 32, 32])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, 64, 2, 2])],
        [numpy_helper.from_array(kernel, name) for name in names],
    )
    path = directory / ("shared.onnx" if shared else "unshared.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    (directory / "data").mkdir(exist_ok=True)
    for i in range(4):
        np.save(directory / "data" / f"{i}.npy", rng.normal(0, 1, (1, 64, 32, 32)).astype(np.float32))
    return path


def _quantize(tmp_path: Path, config: str | None, *, shared: bool = True) -> tuple[Path, Path, qtool.QuantizeResult]:
    model = _shared_kernel_model(tmp_path, shared=shared)
    config_path = None
    if config is not None:
        config_path = tmp_path / "c.yaml"
        config_path.write_text(config)
    out = tmp_path / f"{model.stem}.q.onnx"
    result = qtool.quantize(
        model, out, data_dir=tmp_path / "data", config_path=config_path, search=None, evaluation=None
    )
    return model, out, result


def _kernel_copies(path: Path) -> list[onnx.TensorProto]:
    return [i for i in onnx.load(str(path)).graph.initializer if tuple(i.dims) == KERNEL]


def _sqnr_db(model: Path, out: Path, data: Path) -> float:
    x = np.load(data / "0.npy")
    reference, candidate = run_model(model, {"x": x})[0], run_model(out, {"x": x})[0]
    return float(10 * np.log10((reference**2).sum() / ((reference - candidate) ** 2).sum()))


def _optimized_ops(path: Path, tmp_path: Path) -> collections.Counter:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


def _restored_kernels(path: Path) -> dict[str, np.ndarray]:
    """Every float form of the kernel in the quantized model, computed by onnx's ReferenceEvaluator."""
    model = onnx.load(str(path))
    inits = {i.name for i in model.graph.initializer}
    restoring = [n for n in model.graph.node if n.name.startswith("w/")]  # the nodes that restore the kernel
    conv_inputs = {i for c in model.graph.node if c.op_type == "Conv" for i in c.input}
    outputs = [o for n in restoring for o in n.output if o in conv_inputs]
    assert all(i in inits or any(i in r.output for r in restoring) for n in restoring for i in n.input)
    graph = helper.make_graph(
        restoring,
        "kernel",
        [],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        list(model.graph.initializer),
    )
    # opset 19: the first DequantizeLinear the evaluator implements, with the same semantics as 13's
    restored = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])).run(None, {})
    return dict(zip(outputs, restored, strict=True))


@pytest.mark.parametrize(
    ("config", "as_if_separate"),
    [
        # auto: the 32x32 Convs integer, the 2x2 ones storage; the integer kernels' int8 weights fitted where
        # their pairs could saturate: the storage readers share that grid
        (None, False),
        # uint8 around 128 holds int8's levels: the storage readers compute what they would alone
        ("global: {weight: {saturation: uint8}}\n", True),
        # explicit placements mixed with auto ones
        (
            "global: {weight: {saturation: uint8}}\n"
            "node_name: {big0: {placement: storage}, small0: {placement: integer}}\n",
            True,
        ),
        # the integer kernels' int8 weights in the reduced range [-64, 63]: the storage readers share that grid
        ("global: {weight: {saturation: reduce_range}}\n", False),
    ],
)
def test_a_kernel_shared_by_integer_and_storage_convs_is_stored_once(tmp_path, config, as_if_separate):
    model, out, result = _quantize(tmp_path, config)
    weighted = {kind: count for kind, count in result.placements.items() if kind != "chained"}
    assert weighted == {"integer": 3, "storage": 3}
    weighted_kernels = {kernel: n for kernel, n in result.kernels.items() if "Conv" in kernel}
    assert weighted_kernels == {"QLinearConv": 3, "float Conv": 3}
    assert result.rewrite.quantized_weights == ["w"] and result.rewrite.weight_copies == {}
    (stored,) = _kernel_copies(out)
    assert stored.data_type in (TensorProto.INT8, TensorProto.UINT8)
    assert "w" not in {i.name for i in onnx.load(str(out)).graph.initializer}  # no float copy either
    # 147,456 float bytes become 36,864: the file is a quarter of the model, plus scales and graph
    assert result.compression_ratio > 3.5, result.compression_ratio
    # both forms (DequantizeLinear for the integer kernels, Cast/Mul for the storage Convs) restore the same kernel
    forms = _restored_kernels(out)
    assert len(forms) == 2
    first, second = forms.values()
    np.testing.assert_array_equal(first, second)
    # onnxruntime still fuses the integer Convs and folds the storage form at load
    ops = _optimized_ops(out, tmp_path)
    assert ops["QLinearConv"] == 3 and ops["Conv"] == 3 and ops["Cast"] == 0, ops
    assert _sqnr_db(model, out, tmp_path / "data") > 28
    if as_if_separate:  # uint8 around 128 holds int8's levels: the storage Convs compute what they would alone
        _, separate, alone = _quantize(tmp_path, config, shared=False)
        assert alone.rewrite.quantized_weights == [f"w{i}" for i in range(6)]
        x = np.load(tmp_path / "data" / "0.npy")
        np.testing.assert_array_equal(run_model(out, {"x": x})[0], run_model(separate, {"x": x})[0])


def test_readers_asking_for_different_schemes_each_get_their_copy(tmp_path):
    # saturation: uint8 stores the int8 copy with int8's own levels, so each reader computes what it would alone
    config = "global: {weight: {saturation: uint8}}\nnode_name: {small0: {weight: {dtype: int4}}}\n"
    _, out, result = _quantize(tmp_path, config)
    assert result.rewrite.weight_copies == {"w": 2}
    assert sorted(i.data_type for i in _kernel_copies(out)) == [TensorProto.UINT8, TensorProto.INT4]
    assert result.kernels == {"QLinearConv": 3, "float Conv": 3}
    assert _optimized_ops(out, tmp_path)["QLinearConv"] == 3
    # the same as when each Conv has a kernel of its own
    _, separate, _ = _quantize(tmp_path, config, shared=False)
    x = np.load(tmp_path / "data" / "0.npy")
    np.testing.assert_allclose(run_model(out, {"x": x})[0], run_model(separate, {"x": x})[0], atol=1e-5)


def test_weights_read_by_shape_nodes_are_not_kept_in_float(tmp_path):
    # w_dead is read only by a Shape, w_live by a Shape and a MatMul: before folding, the output kept both
    # float weights next to the quantized one and was larger than the input (0.89x)
    model = tmp_path / "tf2onnx.onnx"
    onnx.save(tf2onnx_shapes_model(256, 256), str(model))
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        np.save(tmp_path / "data" / f"{i}.npy", rng.normal(0, 1, (1, 256)).astype(np.float32))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(model, out, data_dir=tmp_path / "data", search=None, evaluation=None)
    assert result.prepare.folded_shapes == ["shape_dead", "shape_live"]
    assert result.rewrite.quantized_weights == ["w_live"]
    assert not {"w_dead", "w_live"} & {i.name for i in onnx.load(str(out)).graph.initializer}
    assert result.compression_ratio > 7, result.compression_ratio  # two float weights -> one int8 weight
    x = rng.normal(0, 1, (5, 256)).astype(np.float32)
    reference, candidate = run_model(model, {"x": x})[0], run_model(out, {"x": x})[0]
    assert 10 * np.log10((reference**2).sum() / ((reference - candidate) ** 2).sum()) > 30
