"""quantize --vs-onnxruntime: onnxruntime's quantize_static model of the same file, measured beside qtool's."""

from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import QtoolError
from tests.conftest import calib_dir, eval_dir, run_model, sample

runner = CliRunner()


def _worst_sqnr(reference: str, candidate: str, folder) -> float:
    """The worst output's SQNR, each output pooled over the folder's samples (numpy, as a reader would)."""
    signal, noise = {}, {}
    for path in sorted(folder.glob("*.npy")):
        feed = {ort.InferenceSession(reference).get_inputs()[0].name: np.load(path)[None]}
        for i, (r, c) in enumerate(zip(run_model(reference, feed), run_model(candidate, feed), strict=True)):
            r, c = r.astype(np.float64), c.astype(np.float64)
            signal[i] = signal.get(i, 0.0) + float(np.sum(r * r))
            noise[i] = noise.get(i, 0.0) + float(np.sum((r - c) ** 2))
    return min(10 * math.log10(signal[i] / noise[i]) for i in signal)


def test_the_side_by_side_scores_onnxruntimes_own_model_of_the_same_file(tmp_path, monkeypatch):
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    monkeypatch.chdir(tmp_path)  # nothing of onnxruntime's scratch files may land in the working directory
    r = runner.invoke(
        app,
        [
            *("quantize", str(sample("cnn")), "--data", str(calib_dir("cnn")), "--eval", str(eval_dir("cnn"))),
            *("-o", str(out), "--json", str(report), "--vs-onnxruntime", "--runs", "8"),
        ],
    )
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx", "r.json"]
    peer = json.loads(report.read_text())["peer"]
    rows = {row["model"]: row for row in peer["rows"]}
    assert list(rows) == ["fp32", "qtool", "onnxruntime quantize_static"]
    assert peer["held_out"] and peer["samples"] == 32 and peer["runs"] == 8 and not peer["notes"]
    assert rows["fp32"]["speedup_one_thread"] == rows["fp32"]["speedup_all_threads"] == 1.0
    assert rows["fp32"]["bytes"] == sample("cnn").stat().st_size and rows["qtool"]["bytes"] == out.stat().st_size
    for row in (rows["qtool"], rows["onnxruntime quantize_static"]):
        assert 0 < row["speedup_one_thread"] < 10 and 0 < row["speedup_all_threads"] < 10
    # qtool's row is its written model, scored by numpy on the evaluation files
    assert rows["qtool"]["worst_sqnr_db"] == pytest.approx(_worst_sqnr(str(sample("cnn")), str(out), eval_dir("cnn")))
    # onnxruntime's row is onnxruntime's recipe run by hand on the same calibration files
    pre, theirs = tmp_path / "pre.onnx", tmp_path / "ort.onnx"
    quant_pre_process(str(sample("cnn")), str(pre))
    name = ort.InferenceSession(str(sample("cnn"))).get_inputs()[0].name

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.files = iter(sorted(calib_dir("cnn").glob("*.npy")))

        def get_next(self):
            path = next(self.files, None)
            return None if path is None else {name: np.load(path)[None]}

    quantize_static(
        str(pre),
        str(theirs),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )
    expected = _worst_sqnr(str(sample("cnn")), str(theirs), eval_dir("cnn"))
    assert rows["onnxruntime quantize_static"]["worst_sqnr_db"] == pytest.approx(expected, abs=1e-3)
    assert "beside onnxruntime's quantize_static" in r.stdout and "held-out" in r.stdout


def test_a_model_onnxruntime_cannot_quantize_is_reported_not_fatal(tmp_path, monkeypatch):
    import qtool.evaluation.peer as peer

    def refuses(model, feeds, out):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : no kernel\nsecond line")

    monkeypatch.setattr(peer, "quantize_with_onnxruntime", refuses)
    result = qtool.quantize(
        sample("mlp"), tmp_path / "q.onnx", data_dir=calib_dir("mlp"), evaluation=None, vs_onnxruntime=True
    )
    assert result.peer is not None and [row.model for row in result.peer.rows] == ["fp32", "qtool"]
    assert result.peer.notes == [
        "onnxruntime's quantize_static failed on this model (RuntimeError: [ONNXRuntimeError] : 1 : FAIL : no kernel)"
    ]


def test_the_side_by_side_needs_calibration_samples(tmp_path):
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(sample("mlp")), "-o", str(out), "--vs-onnxruntime"])
    assert r.exit_code == 2 and "--vs-onnxruntime needs --data DIR" in r.stderr and not out.exists()
    with pytest.raises(QtoolError, match="needs --data"):
        qtool.quantize(sample("mlp"), out, stats_path=None, vs_onnxruntime=True)
    assert not out.exists()


def test_relative_sample_folders_reach_onnxruntime_from_its_scratch_directory(tmp_path, monkeypatch):
    # onnxruntime calibrates inside a scratch directory: a relative --data path must still name the samples
    monkeypatch.chdir(calib_dir("cnn").parent)
    out = tmp_path / "q.onnx"
    result = qtool.quantize(
        sample("cnn"),
        out,
        data_dir=calib_dir("cnn").name,
        eval_dir=eval_dir("cnn").name,
        evaluation=None,
        vs_onnxruntime=True,
    )
    assert result.peer is not None and not result.peer.notes
    rows = {row.model: row for row in result.peer.rows}
    assert rows["onnxruntime quantize_static"].worst_sqnr_db is not None
    assert rows["onnxruntime quantize_static"].worst_sqnr_db > 20
