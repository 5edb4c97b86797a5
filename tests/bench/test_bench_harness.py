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
