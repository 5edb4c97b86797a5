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
    github_env = tmp_path / "github.env"
    github_env.write_text("")
    env["GITHUB_ENV"] = str(github_env)
    for step in _steps():
        if "run" not in step or step["name"] == "Install qtool":
            continue
        if failed and step.get("if") != "always()":
            continue
        # what earlier steps put in $GITHUB_ENV, and the step's own env (GitHub expressions: the overrides')
        exported = dict(line.split("=", 1) for line in github_env.read_text().splitlines() if "=" in line)
        own = {k: str(v) for k, v in (step.get("env") or {}).items() if "${{" not in str(v)}
        proc = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", step["run"]],
            cwd=tmp_path,
            env={**env, **own, **exported},
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
    names = [
        "Calibrate",
        "Quantize",
        "Accept an intended change?",
        "Compare and gate",
        "Keep this report as main's baseline",
        "Publish the report",
    ]
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


def test_the_workflow_uses_a_pip_cache_a_ref_that_exists_and_the_default_branch():
    workflow = _workflow()
    setup = next(s for s in _steps() if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip"
    assert workflow["env"]["QTOOL_PACKAGE"].endswith("@main")  # no tag the project does not have
    keep = next(s for s in _steps() if s.get("name") == "Keep this report as main's baseline")
    assert "default_branch" in keep["if"] and "'refs/heads/main'" not in WORKFLOW.read_text()
    assert "accept_change" in workflow[True]["workflow_dispatch"]["inputs"]  # yaml reads "on" as True


@pytest.mark.slow
def test_a_change_made_on_purpose_is_gated_until_accepted_then_becomes_the_baseline(tmp_path):
    """Main's report; a better model passes as it is; a worse one fails, and accepted by a trailer it passes
    and replaces the baseline."""
    # accuracy and size only: timing drifts between runs on a shared machine (the latency gate is tested above)
    loose = {**_sample_env(), "MIN_SQNR_DB": "0", "MIN_COSINE": "0", "MIN_COMPRESSION": "1"}
    loose |= {"MAX_LATENCY_RATIO": "", "RUNS": "0"}
    assert all(code == 0 for _, code, _ in _run_steps(tmp_path, loose))  # main: the default config
    baseline = json.loads((tmp_path / "baseline" / "report.json").read_text())
    # better on purpose: 16-bit activations (the installed "w8a16" config), the same int8 weights, more accurate
    steps = {name: (code, output) for name, code, output in _run_steps(tmp_path, {**loose, "CONFIG": "w8a16"})}
    assert steps["Compare and gate"][0] == 0, steps["Compare and gate"][1][-3000:]
    better = json.loads((tmp_path / "report.json").read_text())
    assert better["baseline"]["regressed"] is False
    assert better["accuracy"]["overall"]["sqnr_db"] > baseline["accuracy"]["overall"]["sqnr_db"]
    (tmp_path / "baseline" / "report.json").write_text(json.dumps(baseline))  # main stays at the default
    # worse on purpose: fp16 weights, twice the bytes of int8, a size regression the gate catches
    worse = {**loose, "CONFIG": "fp16"}
    results = dict((name, code) for name, code, _ in _run_steps(tmp_path, worse))
    assert results["Compare and gate"] != 0 and "Keep this report as main's baseline" not in results
    assert json.loads((tmp_path / "baseline" / "report.json").read_text()) == baseline  # unchanged
    # the same change with the trailer: measured and reported, not failed, and it becomes the baseline
    accepted = {**worse, "MESSAGE": "Ship fp16 weights\n\nQtool-Accept-Change: yes"}
    results = dict((name, code) for name, code, _ in _run_steps(tmp_path, accepted))
    assert results["Compare and gate"] == 0 and results["Keep this report as main's baseline"] == 0
    kept = json.loads((tmp_path / "baseline" / "report.json").read_text())
    assert kept["baseline"]["regressed"] is True
    assert kept["size"]["candidate_bytes"] > baseline["size"]["candidate_bytes"]
    assert "Regress" in (tmp_path / "report.md").read_text() or "regress" in (tmp_path / "report.md").read_text()


def test_runs_0_measures_and_gates_no_latency_even_with_a_latency_ratio_set(tmp_path):
    env = {**_sample_env(), "MIN_SQNR_DB": "0", "MIN_COSINE": "0", "MIN_COMPRESSION": "1", "RUNS": "0"}
    results = {name: (code, output) for name, code, output in _run_steps(tmp_path, env)}
    assert results["Compare and gate"][0] == 0, results["Compare and gate"][1][-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["latency"] == [] and all(g["metric"] != "latency_ratio" for g in report["gates"]["results"])


@pytest.mark.slow
def test_a_qtool_upgrade_is_accepted_once_and_its_report_replaces_the_old_baseline(tmp_path):
    loose = {**_sample_env(), "MIN_SQNR_DB": "0", "MIN_COSINE": "0", "MIN_COMPRESSION": "1", "RUNS": "0"}
    assert all(code == 0 for _, code, _ in _run_steps(tmp_path, loose))
    old = json.loads((tmp_path / "baseline" / "report.json").read_text())
    old["schema_version"] = 2  # as an older qtool wrote it
    (tmp_path / "baseline" / "report.json").write_text(json.dumps(old))
    # not accepted: the gate against it cannot be judged, and the message says how to go on
    steps = {name: (code, output) for name, code, output in _run_steps(tmp_path, loose)}
    code, output = steps["Compare and gate"]
    assert code == 2 and "schema version 2" in output and "accept the change" in output
    assert json.loads((tmp_path / "baseline" / "report.json").read_text())["schema_version"] == 2
    # accepted by the trailer: compared for information, passed over with a warning, and replaced
    accepted = {**loose, "MESSAGE": "Upgrade qtool\n\nQtool-Accept-Change: yes"}
    steps = {name: (code, output) for name, code, output in _run_steps(tmp_path, accepted)}
    assert steps["Compare and gate"][0] == 0 and "not compared" in steps["Compare and gate"][1]
    assert steps["Keep this report as main's baseline"][0] == 0
    assert json.loads((tmp_path / "baseline" / "report.json").read_text())["schema_version"] == 3
    # and the next run compares against the new baseline again
    assert all(code == 0 for _, code, _ in _run_steps(tmp_path, loose))
    assert json.loads((tmp_path / "report.json").read_text())["baseline"] is not None
