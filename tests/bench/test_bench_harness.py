"""The benchmark harness runs end to end on one small model (it measures; it asserts nothing itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_runs_on_the_sample_mlp(tmp_path):
    before = {p.name for p in ROOT.iterdir()}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "run.py"),
            "--models",
            "mlp",
            "--quick",
            "--runs",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # quant_pre_process writes sym_shape_infer_temp.onnx into its working directory: never the repository's
    assert {p.name for p in ROOT.iterdir()} - before == set()
    document = json.loads((tmp_path / "latest.json").read_text())
    runs = document["rows"][0]["runs"]
    assert set(runs) == {"onnxruntime | minmax per-channel", "qtool | minmax per-channel", "qtool | default", "fp32"}
    # onnxruntime's full-range int8 weights saturate on x86 CPUs without VNNI (29 dB on AVX2 here, 42 with VNNI)
    assert runs["onnxruntime | minmax per-channel"]["sqnr_db"] > 20
    assert runs["qtool | minmax per-channel"]["sqnr_db"] > 30
    for key in ("onnxruntime | minmax per-channel", "qtool | minmax per-channel"):
        assert runs[key]["integer_fraction"] == 1.0
        assert runs[key]["speedup_1t"] > 0 and runs[key]["compression"] > 3
    assert document["versions"]["onnxruntime"] and document["machine"]["model"]
    assert "| mlp | qtool | default |" in (tmp_path / "latest.md").read_text()


@pytest.mark.slow
def test_observer_bench_runs_on_the_sample_cnn(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "observers.py"),
            "--models",
            "cnn",
            "--observers",
            "minmax,percentile",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "observers.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bare", "unexposed", "minmax", "percentile"]
    assert all(r["seconds"] > 0 and not r["errors"] for r in rows)
    assert rows[3]["overhead"] is not None and rows[3]["float_pass"] > 0  # the float pass was timed from qtool's log
    assert "| cnn | percentile |" in (tmp_path / "observers.md").read_text()


def test_onnxruntime_per_channel_peer_runs_on_an_opset_11_model(tmp_path):
    """onnxruntime writes per-channel DequantizeLinear into an opset-11 model as it is (no runtime loads it)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from bench.measure import onnxruntime_quantize_static

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1] * 4), helper.make_node("Relu", ["c"], ["y"])],
        "opset11",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        [weight],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), model)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(4):
        np.save(calib / f"{i}.npy", rng.standard_normal((3, 16, 16)).astype(np.float32))
    out = tmp_path / "q.onnx"
    note = onnxruntime_quantize_static(str(model), str(calib), str(out), per_channel=True, method="MinMax")
    assert "from opset 11 to 13" in note
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = session.run(None, {"x": x})[0]
    assert 10 * np.log10(np.sum(reference**2) / np.sum((reference - got) ** 2)) > 20


def test_a_model_onnxruntime_refuses_is_a_rows_error_not_the_benchmarks_end(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from bench.cost import _unloadable

    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1])],  # a 4-D perm on a 1-D input
        "refused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [36])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    refused, fine = tmp_path / "refused.onnx", tmp_path / "fine.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), refused)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "fine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [36])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [36])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), fine)
    assert _unloadable(refused).startswith("onnxruntime cannot load the model it wrote: ")
    assert _unloadable(fine) is None
