"""The quantize pipeline's statistics: read from a file, observed on samples, or none needed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

import qtool
from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.options import DEFAULT_CALIBRATION, DEFAULT_OUTPUT
from qtool.pipeline.quantize import QuantizeRequest, check_outputs, statistics
from qtool.pipeline.workspace import open_workspace
from tests.conftest import calib_dir, sample


def _request(tmp_path, **given) -> QuantizeRequest:
    fields = {
        "output_path": tmp_path / "q.onnx",
        "stats_path": None,
        "data_dir": None,
        "calibration": DEFAULT_CALIBRATION,
        "search": None,
        "evaluation": None,
        "eval_dir": None,
        "output": DEFAULT_OUTPUT,
    }
    return QuantizeRequest(**{**fields, **given})


def test_samples_are_observed_once_and_keep_the_float_outputs(tmp_path):
    ws = open_workspace(sample("cnn"), load_config())
    found = statistics(ws, _request(tmp_path, data_dir=calib_dir("cnn")), None)
    assert found.calibrated and found.stats.samples == len(list(calib_dir("cnn").iterdir()))
    assert found.known is not None and found.stats.tensors


def test_a_statistics_file_is_read_and_the_same_ranges_come_back(tmp_path):
    stats = qtool.calibrate(sample("cnn"), calib_dir("cnn"))
    qtool.write_stats(stats, tmp_path / "s.json")
    ws = open_workspace(sample("cnn"), load_config())
    found = statistics(ws, _request(tmp_path, stats_path=tmp_path / "s.json"), None)
    assert not found.calibrated and found.known is None
    assert set(found.stats.tensors) == set(stats.tensors)


def test_a_config_that_needs_statistics_without_any_is_refused_naming_what_needs_them(tmp_path):
    ws = open_workspace(sample("cnn"), load_config({"global": {"placement": "integer"}}))
    with pytest.raises(QtoolError, match="activations are quantized statically"):
        statistics(ws, _request(tmp_path), None)


def test_weight_only_needs_no_statistics(tmp_path):
    ws = open_workspace(sample("mlp"), load_config({"global": {"weight_only": True}}))
    found = statistics(ws, _request(tmp_path), None)
    assert found.stats.samples == 0 and found.collector is None


def test_the_output_must_be_a_new_onnx_file(tmp_path):
    with pytest.raises(QtoolError, match=r"must end in \.onnx"):
        check_outputs(sample("cnn"), tmp_path / "q.bin")
    with pytest.raises(QtoolError, match="never overwrites its input"):
        check_outputs(sample("cnn"), sample("cnn"))


def test_the_comparison_reads_the_models_held_in_memory_and_measures_what_compare_measures(tmp_path, monkeypatch):
    import qtool.evaluation.opened as opened
    from qtool.options import QUANTIZE_EVALUATION

    read: list[str] = []
    real = opened.load_model
    monkeypatch.setattr(opened, "load_model", lambda path, *a, **k: read.append(str(path)) or real(path, *a, **k))
    out = tmp_path / "q.onnx"
    result = qtool.quantize(
        sample("cnn"), out, data_dir=calib_dir("cnn"), search=None, evaluation=replace(QUANTIZE_EVALUATION, runs=0)
    )
    assert read == []  # neither the input nor the output was read again
    held = result.comparison
    assert held is not None and held.reference.sha256 == result.source.sha256
    assert held.candidate == result.output  # the file as written: size and digest
    again = qtool.compare(sample("cnn"), out, calib_dir("cnn"), options=replace(QUANTIZE_EVALUATION, runs=0))
    assert read == [str(sample("cnn")), str(out)]  # compare itself reads both files
    # the same candidate outputs; the float ones quantize took from calibration's pass of the prepared model
    assert [o.name for o in held.outputs] == [o.name for o in again.outputs]
    assert all(abs(h.sqnr_db - a.sqnr_db) < 1e-3 for h, a in zip(held.outputs, again.outputs, strict=True))


@pytest.mark.parametrize("training", [True, False])
def test_a_model_exported_in_training_form_is_said_to_be(tmp_path, training):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(8)
    inits = [
        numpy_helper.from_array((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32), "w"),
        *(numpy_helper.from_array(v.astype(np.float32), n) for n, v in (("s", np.ones(16)), ("b", np.zeros(16)))),
        *(numpy_helper.from_array(v.astype(np.float32), n) for n, v in (("m", np.zeros(16)), ("v", np.ones(16)))),
        numpy_helper.from_array(np.array(0.1, np.float32), "ratio"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(  # training form: the batch's statistics, and the running ones as two more outputs
            "BatchNormalization",
            ["c", "s", "b", "m", "v"],
            ["n", "running_mean", "running_var"] if training else ["n"],
            name="bn",
            training_mode=training,
        ),
        helper.make_node("Constant", [], ["train"], value=numpy_helper.from_array(np.array(training))),
        helper.make_node("Dropout", ["n", "ratio", "train"], ["y"], name="drop", seed=1),
    ]
    graph = helper.make_graph(
        nodes,
        "trained",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])],
        inits,
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 8, 16, 16)).astype(np.float32))
    result = qtool.quantize(model, tmp_path / "q.onnx", data_dir=data, evaluation=None, search=None)
    said = [n for n in result.notes if "training form" in n]
    if training:
        assert said == [
            "the model was exported in training form: 1 BatchNormalization normalize each batch by its own "
            "statistics and 1 Dropout drop values at random; export it with model.eval() to quantize what it runs"
        ]
    else:
        assert said == []
