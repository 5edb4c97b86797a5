"""Golden snapshots of what qtool writes for the sample models: a refactor must not change them.

Each snapshot is the rewritten graph (nodes in order with their inputs, outputs and attributes; every
initializer's type and shape; integer weights by digest) and the deterministic part of the quantize
report. Calibration-dependent floats (activation scales, int32 biases) are kept to 4 significant
digits so that float differences between CPUs do not count. ``make golden`` rewrites the files;
review their diff like code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import qtool
from qtool.reports.documents import quantize_to_dict
from tests.conftest import INTEGER, calib_dir, sample

GOLDEN = Path(__file__).parent
UPDATE = os.environ.get("QTOOL_UPDATE_GOLDEN") == "1"
CASES = [(name, config) for name in ("cnn", "mlp", "transformer") for config in ("default", "integer")]


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def _attribute(a: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, float):
        return _sig(value, 6)
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return str(value) if not isinstance(value, (int, str)) else value


def _initializer(t: onnx.TensorProto) -> list[Any]:
    array = numpy_helper.to_array(t)
    head = [onnx.TensorProto.DataType.Name(t.data_type), list(t.dims)]
    if array.dtype.kind == "f":
        values = np.abs(array.astype(np.float64))
        return [*head, _sig(float(values.max(initial=0.0))), _sig(float(values.mean()) if values.size else 0.0)]
    if t.data_type == onnx.TensorProto.INT32:  # biases: scaled by calibrated activation scales
        return [*head, _sig(float(np.abs(array.astype(np.float64)).max(initial=0.0)), 3)]
    return [*head, hashlib.sha256(array.tobytes()).hexdigest()[:16]]


def snapshot(model: onnx.ModelProto, report: dict[str, Any]) -> dict[str, Any]:
    """The deterministic shape of a quantized model and its report."""
    scales = {t.name for t in model.graph.initializer if t.name.endswith("/scale")}
    return {
        "opset": [[o.domain, o.version] for o in model.opset_import],
        "nodes": [
            [n.op_type, n.name, list(n.input), list(n.output), {a.name: _attribute(a) for a in n.attribute}]
            for n in model.graph.node
        ],
        "initializers": {
            t.name: _initializer(t) if t.name not in scales else ["scale", list(t.dims)]
            for t in sorted(model.graph.initializer, key=lambda t: t.name)
        },
        "report": {
            key: report[key]
            for key in ("quantized", "skipped", "passthrough_ops", "placements", "predicted_kernels")
            if key in report
        },
    }


@pytest.mark.parametrize(("name", "config"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_quantized_samples_match_their_golden_snapshot(tmp_path, name, config):
    stats = qtool.calibrate(sample(name), calib_dir(name), config_path=INTEGER if config == "integer" else None)
    stats_path = tmp_path / "stats.json"
    qtool.write_stats(stats, stats_path)
    out = tmp_path / "q.onnx"
    result = qtool.quantize(
        sample(name), out, stats_path=stats_path, config_path=INTEGER if config == "integer" else None
    )
    got = snapshot(onnx.load(str(out)), json.loads(json.dumps(quantize_to_dict(result))))
    golden = GOLDEN / f"{name}.{config}.json"
    if UPDATE:
        golden.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert golden.exists(), f"no snapshot {golden.name}: run make golden"
    expected = json.loads(golden.read_text())
    assert got == expected, f"{golden.name} changed: if intended, run make golden and review the diff"
