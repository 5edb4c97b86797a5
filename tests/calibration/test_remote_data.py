"""Datasets behind fsspec URLs (memory:// here): detected and validated as local folders, never written to."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import qtool
from qtool.calibration.remote import is_url, sample_files
from qtool.cli import app
from qtool.errors import QtoolError
from qtool.options import EvaluationOptions, SearchOptions
from tests.conftest import calib_dir, eval_dir, sample

fsspec = pytest.importorskip("fsspec", reason="the remote extra is not installed")
runner = CliRunner()


@pytest.fixture
def memory():
    fs = fsspec.filesystem("memory")
    yield fs
    for root in fs.ls("/", detail=False):
        if "qtool-test" in root:
            fs.rm(root, recursive=True)


def _upload(fs, folder, url_path: str) -> str:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fs.pipe(f"{url_path}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    return f"memory://{url_path.lstrip('/')}"


def test_url_detection():
    assert is_url("s3://bucket/data") and is_url("memory://x") and is_url("https://host/a/")
    assert not is_url("data/calib") and not is_url("/abs/path") and not is_url("C:\\data") and not is_url(None)


def test_a_url_calibrates_and_quantizes_like_the_local_folder(memory, tmp_path):
    url = _upload(memory, calib_dir("cnn"), "/qtool-test/cnn/calib")
    memory.pipe("/qtool-test/cnn/calib/README.txt", b"not a sample")  # ignored, as in a local folder
    before = {path: memory.cat(path) for path in memory.find("/qtool-test")}
    assert qtool.calibrate(sample("cnn"), url).to_json() == qtool.calibrate(sample("cnn"), calib_dir("cnn")).to_json()
    # untimed (--latency-runs 0): the same data must give the same bytes, whatever the timing would pick
    result = runner.invoke(
        app,
        ["quantize", str(sample("cnn")), "--data", url, "-o", str(tmp_path / "q.onnx"), "--latency-runs", "0"],
    )
    assert result.exit_code == 0, result.stderr
    local = tmp_path / "local.onnx"
    qtool.quantize(
        sample("cnn"), local, data_dir=calib_dir("cnn"), evaluation=None, search=SearchOptions(latency_runs=0)
    )
    assert (tmp_path / "q.onnx").read_bytes() == local.read_bytes()
    onnx.checker.check_model(str(tmp_path / "q.onnx"))
    assert {path: memory.cat(path) for path in memory.find("/qtool-test")} == before  # nothing written there


def test_compare_reads_evaluation_samples_from_a_url(memory, quantized_samples):
    url = _upload(memory, eval_dir("mlp"), "/qtool-test/mlp/eval")
    remote = qtool.compare(sample("mlp"), quantized_samples["mlp"], url, options=EvaluationOptions(runs=0))
    local = qtool.compare(sample("mlp"), quantized_samples["mlp"], eval_dir("mlp"), options=EvaluationOptions(runs=0))
    assert remote.samples == local.samples == 32 and remote.data_dir == url  # the URL, not the temporary copy
    assert remote.overall.sqnr_db == pytest.approx(local.overall.sqnr_db, abs=1e-9)


def test_onnx_test_data_sets_behind_a_url(memory, tmp_path):
    folder = tmp_path / "sets"
    for i, path in enumerate(sorted(calib_dir("mlp").glob("*.npy"))[:4]):
        tensor = onnx.numpy_helper.from_array(np.load(path)[None] if np.load(path).ndim == 1 else np.load(path))
        (folder / f"test_data_set_{i}").mkdir(parents=True)
        (folder / f"test_data_set_{i}" / "input_0.pb").write_bytes(tensor.SerializeToString())
    url = _upload(memory, folder, "/qtool-test/sets")
    assert [relative for _, relative in sample_files(url)] == [f"test_data_set_{i}/input_0.pb" for i in range(4)]
    assert qtool.calibrate(sample("mlp"), url).to_json() == qtool.calibrate(sample("mlp"), folder).to_json()


def test_a_bad_sample_behind_a_url_is_named_by_its_url(memory, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(calib_dir("mlp"), folder)
    (folder / "zz_bad.npy").write_bytes(b"not numpy")
    url = _upload(memory, folder, "/qtool-test/bad")
    result = runner.invoke(app, ["calibrate", str(sample("mlp")), url, "-o", str(tmp_path / "s.json")])
    assert result.exit_code == 2
    assert "memory://qtool-test/bad/zz_bad.npy" in result.stderr and "qtool-remote-" not in result.stderr
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://qtool-test/missing", "data directory not found: memory://qtool-test/missing"),
        ("nosuchscheme://bucket/data", "nosuchscheme://bucket/data: "),
    ],
)
def test_unusable_urls_are_one_clear_line(memory, tmp_path, url, message):
    result = runner.invoke(app, ["calibrate", str(sample("mlp")), url, "-o", str(tmp_path / "s.json")])
    assert result.exit_code == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_without_fsspec_the_error_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(QtoolError, match=r"need fsspec.*qtool-onnx\[remote\]"):
        qtool.calibrate(sample("mlp"), "memory://qtool-test/x")
