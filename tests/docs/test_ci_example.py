"""examples/github-actions.yml: its run steps work as written, on the sample CNN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, sample

WORKFLOW = ROOT / "examples" / "github-actions.yml"


def _workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps() -> list[dict[str, Any]]:
    return _workflow()["jobs"]["quantize"]["steps"]


def _run_steps(tmp_path: Path, overrides: dict[str, str]) -> list[tuple[str, int, str]]:
    """Run every ``run:`` step but the install (qtool is installed here) as GitHub would.

    A step runs when all before it passed, or always with ``if: always()``; each gets the workflow's
    env, the overrides, this interpreter's bin folder on PATH and a step summary file.
    """
    env = {
        **os.environ,
        **{k: str(v) for k, v in _workflow()["env"].items()},
        **overrides,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
    }
    results: list[tuple[str, int, str]] = []
    failed = False
    for step in _steps():
        if "run" not in step or step["name"] == "Install qtool":
            continue
        if failed and step.get("if") != "always()":
            continue
        proc = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", step["run"]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        results.append((step["name"], proc.returncode, proc.stdout + proc.stderr))
        failed = failed or proc.returncode != 0
    return results


def _sample_env() -> dict[str, str]:
    cnn = sample("cnn")
    return {"MODEL": str(cnn), "CALIB": str(cnn.parent / "calib"), "EVAL": str(cnn.parent / "eval")}


def test_the_install_step_installs_qtool_onnx_from_a_place_the_user_chooses():
    workflow = _workflow()
    install = next(s for s in _steps() if s.get("name") == "Install qtool")
    assert '"$QTOOL_PACKAGE"' in install["run"]
    assert workflow["env"]["QTOOL_PACKAGE"].startswith("qtool-onnx @ ")


@pytest.mark.slow
def test_the_steps_run_as_written_and_every_gate_passes_on_the_sample(tmp_path):
    results = _run_steps(tmp_path, _sample_env())
    names = ["Calibrate", "Quantize", "Compare and gate", "Keep this report as main's baseline", "Publish the report"]
    assert [name for name, _, _ in results] == names
    for name, code, output in results:
        assert code == 0, f"{name} failed:\n{output[-3000:]}"
    assert json.loads((tmp_path / "report.json").read_text())["baseline"] is None  # the first run has none
    quantize = json.loads((tmp_path / "quantize.json").read_text())
    assert quantize["placement_choice"] is not None  # --search-data: the placement was measured with --stats
    report = json.loads((tmp_path / "report.json").read_text())
    gates = report["gates"]["results"]
    assert report["gates"]["passed"] and all(g["passed"] for g in gates)
    assert {g["metric"] for g in gates} >= {"sqnr", "cosine", "compression", "latency_ratio"}
    assert "<testsuite" in (tmp_path / "gates.xml").read_text()
    assert (tmp_path / "summary.md").read_text() == (tmp_path / "report.md").read_text()
    # the next run (a pull request) finds main's report and gates on the change against it
    (tmp_path / "summary.md").unlink()
    for name, code, output in _run_steps(tmp_path, _sample_env()):
        assert code == 0, f"{name} failed on the second run:\n{output[-3000:]}"
    again = json.loads((tmp_path / "report.json").read_text())
    assert again["baseline"]["path"] == "baseline/report.json" and again["baseline"]["regressed"] is False
    assert any(g["metric"] == "sqnr vs baseline" for g in again["gates"]["results"])
    assert "### Against the baseline" in (tmp_path / "summary.md").read_text()


def test_a_failed_calibration_still_publishes_a_summary_and_fails_the_job(tmp_path):
    results = _run_steps(tmp_path, {**_sample_env(), "CALIB": str(tmp_path / "missing")})
    assert [(name, code != 0) for name, code, _ in results] == [("Calibrate", True), ("Publish the report", False)]
    assert "an earlier step failed" in (tmp_path / "summary.md").read_text()
