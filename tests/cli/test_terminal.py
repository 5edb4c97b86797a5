"""The CLI in a terminal and in a pipe: quiet, verbose, full values, no bars or colour, doctor, help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import calib_dir, sample

QTOOL = Path(sys.executable).with_name("qtool")
pytestmark = pytest.mark.skipif(not QTOOL.exists(), reason=f"no qtool console script at {QTOOL}")
COMMANDS = ["calibrate", "quantize", "compare", "inspect", "merge", "observers", "doctor"]


def _qtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """qtool with stdout and stderr as pipes, as in CI logs and `| less`."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TERM")}
    return subprocess.run(
        [str(QTOOL), *map(str, args)], capture_output=True, text=True, timeout=300, check=False, cwd=cwd, env=env
    )


@pytest.mark.slow
def test_piped_tables_keep_full_values_and_have_no_colour_or_bars(tmp_path):
    r = _qtool("inspect", sample("cnn"), "--data", calib_dir("cnn"))
    assert r.returncode == 0, r.stderr
    assert "294,912" in r.stdout  # the float bytes of the middle conv, cut to "294,9…" at 80 columns before
    assert "…" not in r.stdout and "\x1b[" not in r.stdout
    r = _qtool("quantize", sample("cnn"), "--data", calib_dir("cnn"), "-o", tmp_path / "q.onnx")
    assert r.returncode == 0, r.stderr
    assert "━" not in r.stderr  # no progress bars in a pipe
    wrote = next(line for line in r.stdout.splitlines() if line.startswith("wrote "))
    assert "compression" in wrote  # one line, not wrapped at 80 columns


@pytest.mark.slow
def test_quiet_prints_nothing_but_writes_the_outputs(tmp_path):
    report = tmp_path / "q.json"
    r = _qtool("-q", "quantize", sample("cnn"), "--data", calib_dir("cnn"), "-o", tmp_path / "q.onnx", "--json", report)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (r.stdout, r.stderr)
    assert json.loads(report.read_text())["compression_ratio"] > 3
    r = _qtool("-q", "inspect", sample("cnn"), "--json", "-")
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout)["nodes"]
    r = _qtool("-q", "inspect", tmp_path / "missing.onnx")
    assert r.returncode == 2 and r.stderr.startswith("error:")  # errors still show


def test_verbose_logs_every_stage_with_its_duration_and_peak_memory(tmp_path):
    r = _qtool("-v", "calibrate", sample("cnn"), calib_dir("cnn"), "-o", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    timed = [line for line in r.stderr.splitlines() if line.startswith("INFO: ") and " s (peak memory so far " in line]
    assert any("calibrate (float pass):" in line for line in timed), r.stderr
    assert all(line.endswith(" MB)") for line in timed)
    assert any(line.startswith("INFO: load ") for line in timed)
    assert all(len(line) < 200 for line in r.stderr.splitlines())  # no padding to the pipe width


def test_quiet_and_verbose_together_are_a_usage_error():
    r = _qtool("-q", "-v", "observers")
    assert r.returncode == 2


def test_doctor_reports_versions_providers_cpu_and_qdq_opsets():
    r = _qtool("doctor", "--json", "-")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert {"qtool", "onnx", "onnxruntime", "numpy", "python"} <= set(report["versions"])
    assert report["versions"]["histogram counting"] in ("compiled kernel", "numpy (the C kernel is not built)")
    cpu = next(p for p in report["providers"] if p["name"] == "CPUExecutionProvider")
    assert cpu["loads"] is True
    assert report["qdq_kernel_opsets"]["uint8"] >= 19
    assert isinstance(report["int8_kernels_saturate"], bool) and report["cpu"]["machine"]
    r = _qtool("doctor")
    assert r.returncode == 0 and "CPUExecutionProvider" in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_readable_placeholders(command):
    r = _qtool(command, "--help")
    assert r.returncode == 0, r.stderr
    for placeholder in ("<list[str]>", "<int range>", "<float>", "<str>", "<text>"):
        assert placeholder not in r.stdout, f"{command} --help shows {placeholder}"


def test_shell_completion_is_offered():
    r = _qtool("--help")
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout
