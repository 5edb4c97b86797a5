"""Shared fixtures: the bundled sample models and their quantized versions (built once per session)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import qtool

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_models"
SAMPLE_NAMES = ("cnn", "mlp", "transformer")
INTEGER = ROOT / "tests" / "fixtures" / "integer_nearest.yaml"  # every node integer, nearest rounding


@pytest.fixture(autouse=True)
def _own_tune_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own tune cache: no test reads what another measured (or the user's ~/.cache)."""
    directory = tmp_path_factory.mktemp("qtool-cache")
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(directory))
    return directory


def sample(name: str) -> Path:
    return SAMPLES / name / "model.onnx"


def eval_dir(name: str) -> Path:
    return SAMPLES / name / "eval"


def calib_dir(name: str) -> Path:
    return SAMPLES / name / "calib"


def run_model(path: Path | str | bytes, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        path if isinstance(path, bytes) else str(path), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feed)


def save_checked(graph: onnx.GraphProto, path: Path, opset: int = 17) -> Path:
    """Write ``graph`` as a model at the default-domain ``opset`` after onnx's full check; returns ``path``."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session")
def quantized_samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each sample model quantized with every node as an integer kernel, from its calibration set."""
    out = tmp_path_factory.mktemp("quantized")
    result = {}
    for name in SAMPLE_NAMES:
        target = out / f"{name}.int8.onnx"
        qtool.quantize(sample(name), target, data_dir=calib_dir(name), config_path=INTEGER, evaluation=None)
        result[name] = target
    return result
