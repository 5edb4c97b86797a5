"""Per-layer error on models qtool did not make: pairing by graph structure (onnxruntime's quantizer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import qtool
from qtool.calibration.dataset import Dataset, model_inputs
from qtool.evaluation.layers import largest_drop, layer_errors
from qtool.evaluation.pairing import pair_tensors
from qtool.options import EvaluationOptions
from qtool.schemas.reports.compare import Layer
from tests.conftest import calib_dir, eval_dir, sample


def _onnxruntime_static(model: Path, out: Path, tmp_path: Path) -> onnx.ModelProto:
    """onnxruntime's recipe: quant_pre_process (folds BatchNormalization) then QDQ quantize_static."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    dataset = Dataset(calib_dir("cnn"), model_inputs(onnx.load(model)), limit=16)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = (feed for _, feed in dataset.samples())

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    prepared = tmp_path / "pre.onnx"
    quant_pre_process(str(model), str(prepared))
    quantize_static(
        str(prepared),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return onnx.load(out)


@pytest.fixture(scope="module")
def onnxruntime_cnn(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ort")
    out = tmp / "cnn_ort.onnx"
    _onnxruntime_static(sample("cnn"), out, tmp)
    return out


@pytest.fixture(scope="module")
def planted(onnxruntime_cnn, tmp_path_factory) -> Path:
    """onnxruntime's model with block1's Conv weights coarsened to 5 levels: the known worst layer."""
    model = onnx.load(onnxruntime_cnn)
    (weight_dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and "block1.conv.weight" in n.name]
    tables = {t.name: t for t in model.graph.initializer}
    q = numpy_helper.to_array(tables[weight_dq.input[0]]).astype(np.int32)
    coarse = (np.round(q / 64) * 64).clip(-127, 127).astype(np.int8)
    assert np.count_nonzero(coarse != q) > q.size // 2
    tables[weight_dq.input[0]].CopyFrom(numpy_helper.from_array(coarse, weight_dq.input[0]))
    out = tmp_path_factory.mktemp("planted") / "planted.onnx"
    onnx.save(model, out)
    return out


def test_onnxruntime_folds_are_paired_by_structure(onnxruntime_cnn):
    reference, candidate = onnx.load(sample("cnn")), onnx.load(onnxruntime_cnn)
    # onnxruntime folded BatchNormalization into the Conv and dropped the Relu (its uint8 QuantizeLinear
    # clamps): the Conv's float output is not the reference's Relu output, though it bears its name.
    conv = next(n for n in candidate.graph.node if n.name == "block1/conv")
    assert list(conv.output) == ["block1/relu_out"]
    assert not any(n.op_type in ("BatchNormalization", "Relu") for n in candidate.graph.node)
    pairs = {p.reference: p for p in pair_tensors(reference, candidate).pairs}
    relu = pairs["block1/relu_out"]
    assert relu.node == "block1/conv" and relu.folded == ("BatchNormalization", "Relu") and not relu.uncertain
    assert relu.candidate != "block1/relu_out"  # the dequantized copy: the clamp lives in the quantization
    assert pairs["logits"].candidate == "logits"  # the graph output, after its QuantizeLinear/DequantizeLinear
    assert not any(p.uncertain for p in pairs.values())


def test_the_planted_worst_layer_is_found_in_an_onnxruntime_model(planted):
    reference, candidate = onnx.load(sample("cnn")), onnx.load(planted)
    dataset = Dataset(eval_dir("cnn"), model_inputs(reference), limit=8)
    rows = layer_errors(reference, candidate, dataset)
    worst = largest_drop(rows)
    assert worst is not None and worst.node == "block1/conv" and worst.tensor == "block1/relu_out"
    others = [r for r in rows if r.node != "block1/conv"]
    assert worst.drop_db > 10 and worst.drop_db > max(r.drop_db for r in others) + 5
    # every layer is measured against its own input error: not all drops are zero
    assert sum(abs(r.drop_db) > 0.1 for r in rows) >= 4
    # and the per-layer error of the graph output is the accuracy compare reports for it
    result = qtool.compare(sample("cnn"), planted, eval_dir("cnn"), options=EvaluationOptions(limit=8, runs=0))
    logits = next(r for r in rows if r.tensor == "logits")
    assert logits.sqnr_db == pytest.approx(result.outputs[0].sqnr_db, abs=0.01)


def test_a_pairing_the_structure_does_not_confirm_gets_no_drop(onnxruntime_cnn, tmp_path):
    # Take away the QuantizeLinear/DequantizeLinear after block1's Conv: the Relu folded into it is gone
    # with nothing to clamp, so the Conv's output cannot be the reference's Relu output.
    model = onnx.load(onnxruntime_cnn)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "block1/relu_out")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    for node in model.graph.node:
        node.input[:] = ["block1/relu_out" if i == dq.output[0] else i for i in node.input]
    model.graph.node.remove(q)
    model.graph.node.remove(dq)
    out = tmp_path / "unclamped.onnx"
    onnx.save(model, out)
    reference = onnx.load(sample("cnn"))
    dataset = Dataset(eval_dir("cnn"), model_inputs(reference), limit=4)
    rows = {r.tensor: r for r in layer_errors(reference, onnx.load(out), dataset)}
    row = rows["block1/relu_out"]
    assert row.uncertain is not None and "no QuantizeLinear to clamp it" in row.uncertain and row.drop_db is None
    drop = largest_drop(list(rows.values()))
    assert drop is not None and drop.tensor != "block1/relu_out"


def test_reports_written_before_structural_pairing_still_read_as_baselines(onnxruntime_cnn, tmp_path):
    import json

    from qtool.evaluation.baseline import read_baseline
    from qtool.reports.compare_document import comparison_to_dict

    result = qtool.compare(
        sample("cnn"), onnxruntime_cnn, eval_dir("cnn"), options=EvaluationOptions(limit=4, runs=0, per_layer=True)
    )
    document = comparison_to_dict(result)
    layers = document["per_layer"]["layers"]
    assert {layer["paired_by"] for layer in layers} >= {"node name", "name"}
    for layer in layers:  # what an earlier qtool wrote
        for key in ("candidate_tensor", "paired_by", "folded", "uncertain"):
            del layer[key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    assert read_baseline(old).per_layer is not None


def _layer(tensor: str, node: str, op_type: str, sqnr_db: float, input_sqnr_db: float, drop_db: float) -> Layer:
    figures = {"sqnr_db": sqnr_db, "mse": 1e-3, "cosine": 0.99, "input_sqnr_db": input_sqnr_db, "drop_db": drop_db}
    return Layer(tensor=tensor, node=node, op_type=op_type, **figures)


def test_no_layer_is_named_the_largest_drop_when_none_loses_anything():
    # an If whose bodies hold the quantized nodes: its inputs cannot be measured, so it counts as losing nothing
    quiet = _layer("if_out", "If_0", "If", 26.5, 26.5, 0.0)
    better = _layer("relu_out", "relu", "Relu", 30.0, 29.0, -1.0)
    assert largest_drop([quiet, better]) is None
    lossy = _layer("conv_out", "conv", "Conv", 25.0, 30.0, 5.0)
    assert largest_drop([quiet, better, lossy]) is lossy
