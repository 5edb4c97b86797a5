"""Outputs: never an input, checked before any work, kept only when the whole command succeeds.

Covers the output classes of the hostile-input campaign: outputs that would replace an input (by
name, symlink or hard link), bad output paths found only after the work, outputs left behind by a
failed command, SIGTERM/SIGHUP temporaries, and a full or read-only disk reported as a bug.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, eval_dir, sample
from tests.robustness.test_interrupt import QTOOL, _calibrate_args, _leftovers, _quantize_args, _run_to

runner = CliRunner()
CNN, CALIB, EVAL = sample("cnn"), calib_dir("cnn"), eval_dir("cnn")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder with a copy of the sample CNN, its samples, statistics, a config and a quantized model."""
    shutil.copy(CNN, tmp_path / "model.onnx")
    shutil.copytree(CALIB, tmp_path / "calib")
    (tmp_path / "config.yaml").write_text("global: {placement: integer}\n")
    model, stats = str(tmp_path / "model.onnx"), str(tmp_path / "stats.json")
    assert runner.invoke(app, ["calibrate", model, str(tmp_path / "calib"), "-o", stats]).exit_code == 0
    r = runner.invoke(app, ["quantize", model, "--stats", stats, "-o", str(tmp_path / "q.onnx"), "--no-search"])
    assert r.exit_code == 0, r.output
    shutil.copy(tmp_path / "stats.json", tmp_path / "stats2.json")
    return tmp_path


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(work: Path, args: list[str], *, needle: str) -> str:
    """Run qtool; it must exit 2 with one line mentioning ``needle`` and leave every file as it was."""
    before = _files(work)
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert lines[0].startswith("error:") and needle in lines[0], r.output
    assert "Traceback" not in r.output
    assert _files(work) == before
    return lines[0]


def _w(work: Path, name: str) -> str:
    return str(work / name)


# -- an output may never be an input ----------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "calibrate -o MODEL",
        "calibrate --json MODEL",
        "calibrate -o CONFIG",
        "calibrate -o SAMPLE",
        "quantize --json MODEL",
        "quantize --json STATS",
        "quantize --json CONFIG",
        "compare --json REFERENCE",
        "compare --markdown CANDIDATE",
        "compare --junit REFERENCE",
        "inspect --json MODEL",
        "merge -o FIRST_INPUT",
    ],
)
def test_an_output_naming_an_input_is_refused_before_any_work(work, case):
    command, option, target = case.split()
    paths = {
        "MODEL": _w(work, "model.onnx"),
        "CONFIG": _w(work, "config.yaml"),
        "SAMPLE": str(sorted((work / "calib").iterdir())[0]),
        "STATS": _w(work, "stats.json"),
        "REFERENCE": _w(work, "model.onnx"),
        "CANDIDATE": _w(work, "q.onnx"),
        "FIRST_INPUT": _w(work, "stats.json"),
    }
    base = {
        "calibrate": ["calibrate", _w(work, "model.onnx"), _w(work, "calib"), "--config", _w(work, "config.yaml")],
        "quantize": [
            "quantize",
            _w(work, "model.onnx"),
            "--stats",
            _w(work, "stats.json"),
            "-o",
            _w(work, "o.onnx"),
            "--config",
            _w(work, "config.yaml"),
        ],
        "compare": ["compare", _w(work, "model.onnx"), _w(work, "q.onnx"), "--data", _w(work, "calib"), "--runs", "0"],
        "inspect": ["inspect", _w(work, "model.onnx")],
        "merge": ["merge", _w(work, "stats.json"), _w(work, "stats2.json")],
    }[command]
    if command == "calibrate" and option != "-o":
        base += ["-o", _w(work, "s.json")]
    line = _refused(work, [*base, option, paths[target]], needle="never overwrites its inputs")
    assert option in line


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_an_output_linked_to_an_input_is_refused(work, link):
    alias = work / "alias.json"
    (os.symlink if link == "symlink" else os.link)(work / "model.onnx", alias)
    _refused(work, ["inspect", _w(work, "model.onnx"), "--json", str(alias)], needle="is the input")


def test_an_output_naming_the_models_external_data_file_is_refused(work):
    import onnx

    model = onnx.load(str(work / "model.onnx"))
    onnx.save(model, work / "ext.onnx", save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    _refused(work, ["inspect", _w(work, "ext.onnx"), "--json", _w(work, "ext.onnx.data")], needle="ext.onnx.data")


def test_two_outputs_with_one_path_are_refused(work):
    args = ["compare", _w(work, "model.onnx"), _w(work, "q.onnx"), "--data", _w(work, "calib"), "--runs", "0"]
    _refused(work, [*args, "--json", _w(work, "r.txt"), "--markdown", _w(work, "r.txt")], needle="also given as")


# -- bad output paths are found before any work; a failure writes nothing ---------------------------


@pytest.mark.parametrize(
    ("json_target", "needle"),
    [("missing/r.json", "does not exist"), ("calib", "is a directory")],
)
def test_a_bad_json_path_is_refused_before_the_model_is_written(work, json_target, needle):
    out = work / "new.onnx"
    args = ["quantize", _w(work, "model.onnx"), "--stats", _w(work, "stats.json"), "-o", str(out)]
    _refused(work, [*args, "--json", _w(work, json_target)], needle=needle)
    assert not out.exists()


def test_a_failure_after_the_model_is_written_removes_it_and_restores_the_previous_one(work, monkeypatch):
    import qtool.pipeline.quantize
    from qtool.errors import QtoolError

    out = work / "new.onnx"
    out.write_bytes(b"yesterday's model")
    original = qtool.pipeline.quantize.save_model

    def save_then_fail(*args, **kwargs):
        original(*args, **kwargs)
        assert out.read_bytes() != b"yesterday's model"  # the new model was in place
        raise QtoolError("a later step failed")

    monkeypatch.setattr(qtool.pipeline.quantize, "save_model", save_then_fail)
    r = runner.invoke(app, ["quantize", _w(work, "model.onnx"), "--stats", _w(work, "stats.json"), "-o", str(out)])
    assert r.exit_code == 2 and "a later step failed" in r.output
    assert out.read_bytes() == b"yesterday's model"
    assert _leftovers(work) == []


def test_a_failed_gate_keeps_its_reports(work):
    reports = {name: work / name for name in ("r.json", "r.md", "r.xml")}
    args = ["compare", _w(work, "model.onnx"), _w(work, "q.onnx"), "--data", _w(work, "calib"), "--runs", "0"]
    flags = ["--fail-under", "sqnr=200", "--json", str(reports["r.json"]), "--markdown", str(reports["r.md"])]
    r = runner.invoke(app, [*args, *flags, "--junit", str(reports["r.xml"])])
    assert r.exit_code == 1, r.output
    assert all(path.stat().st_size > 0 for path in reports.values())


# -- SIGTERM and SIGHUP are handled like Ctrl-C -------------------------------------------------------


needs_script = pytest.mark.skipif(not QTOOL.exists(), reason=f"no qtool console script at {QTOOL}")


@needs_script
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("point", ["inference", "rename", "written"])
def test_sigterm_and_sighup_leave_no_output_and_no_temporary_file(tmp_path, signum, point):
    out = tmp_path / "model.int8.onnx"
    code, stderr = _run_to(point, _quantize_args(out), tmp_path, signum)
    assert code == 128 + signum, stderr
    assert f"interrupted ({signal.Signals(signum).name}): no output was written" in stderr, stderr
    assert "Traceback" not in stderr
    assert not out.exists() and _leftovers(tmp_path) == []


@needs_script
def test_sigterm_while_the_stats_file_is_renamed_leaves_nothing(tmp_path):
    out = tmp_path / "stats.json"
    code, _ = _run_to("rename", _calibrate_args(out), tmp_path, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and not out.exists() and _leftovers(tmp_path) == []


# -- a full or read-only disk is the user's environment, not a bug ----------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_exit_2(work, tiny_tmpfs):
    out = tiny_tmpfs / "q.onnx"  # the model is ~100 KiB: it cannot fit
    r = runner.invoke(app, ["quantize", _w(work, "model.onnx"), "--stats", _w(work, "stats.json"), "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert "No space left on device" in r.output and str(out) in r.output and "Traceback" not in r.output
    assert list(tiny_tmpfs.iterdir()) == []


def test_a_read_only_folder_is_refused_before_any_work(work, tiny_tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    out = tiny_tmpfs / "stats.json"
    _refused(work, ["calibrate", _w(work, "model.onnx"), _w(work, "calib"), "-o", str(out)], needle="not writable")


def test_disk_full_while_writing_json_is_one_line(work, monkeypatch):
    """ENOSPC from any write (simulated where no tmpfs can be mounted) is exit 2, never 70."""
    real = os.fsync

    def full(fd: int) -> None:
        real(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    r = runner.invoke(app, ["inspect", _w(work, "model.onnx"), "--json", _w(work, "i.json")])
    assert r.exit_code == 2 and "No space left on device" in r.output and "Traceback" not in r.output
    assert not (work / "i.json").exists() and _leftovers(work) == []


# -- findings of the independent hostile campaign ----------------------------------------------------


def _with_external_data(folder: Path, model_name: str, data_name: str) -> Path:
    import onnx

    model = onnx.load(str(CNN))
    path = folder / model_name
    onnx.save(model, path, save_as_external_data=True, location=data_name, size_threshold=0)
    return path


def test_the_data_file_of_a_model_not_named_onnx_is_an_input_too(work):
    model = _with_external_data(work, "model.bin", "weights.onnx")
    _refused(work, ["calibrate", str(model), _w(work, "calib"), "-o", _w(work, "weights.onnx")], needle="is the input")


def test_cleaning_up_earlier_data_files_never_deletes_an_input(work):
    import onnx

    model = _with_external_data(work, "a.onnx", "out.onnx.0123456789abcdef.data")
    args = ["quantize", str(model), "--data", _w(work, "calib"), "-o", _w(work, "out.onnx"), "--no-search"]
    r = runner.invoke(app, [*args, "--runs", "0"])
    assert r.exit_code == 0, r.output  # the output is written, and earlier data files of out.onnx cleaned up
    assert (work / "out.onnx.0123456789abcdef.data").exists()
    onnx.load(str(model))  # the input still loads with its data


def test_a_sample_in_a_linked_folder_is_an_input(work, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    shutil.copy(sorted((work / "calib").iterdir())[0], real / "a.npy")
    data = tmp_path / "data"
    data.mkdir()
    (data / "linked").symlink_to(real)
    shutil.copy(sorted((work / "calib").iterdir())[1], data / "b.npy")
    before = _digest(real / "a.npy")
    r = runner.invoke(app, ["calibrate", _w(work, "model.onnx"), str(data), "-o", str(real / "a.npy")])
    assert r.exit_code == 2 and "never overwrites its inputs" in r.output
    assert _digest(real / "a.npy") == before


def test_a_dash_is_standard_output_only_for_json(work):
    _refused(work, ["calibrate", _w(work, "model.onnx"), _w(work, "calib"), "-o", "-"], needle="this output is a file")


@pytest.mark.parametrize("json_out", [["--json", "-"], []], ids=["json", "tables"])
def test_a_reader_that_closes_stdout_stops_the_command_quietly_with_nothing_written(work, json_out):
    report = work / "report.md"
    model = _w(work, "model.onnx")
    process = subprocess.Popen(
        [QTOOL, "compare", model, model, "--data", eval_dir("cnn"), "--runs", "0", *json_out, "--markdown", report],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    process.stdout.close()  # `qtool ... | head -c 0`: the reader is gone before the JSON or the tables
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGPIPE, stderr.decode()
    assert "Traceback" not in stderr.decode() and "internal error" not in stderr.decode()
    assert not report.exists() and not _leftovers(work)
