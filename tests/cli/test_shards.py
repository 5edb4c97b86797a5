"""Shards calibrated separately and merged give exactly the single-run statistics and model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, sample

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    return result


@pytest.mark.parametrize("observer", ["minmax", "entropy", "percentile", "mse", "mean_std"])
def test_merged_shards_quantize_to_the_same_bytes_as_one_run(tmp_path, observer):
    model, data = sample("cnn"), calib_dir("cnn")
    invoke("calibrate", model, data, "-o", tmp_path / "all.json", "--observer", observer)
    for k in (1, 2, 3):
        invoke("calibrate", model, data, "-o", tmp_path / f"s{k}.json", "--observer", observer, "--shard", f"{k}/3")
    shards = [json.loads((tmp_path / f"s{k}.json").read_text()) for k in (1, 2, 3)]
    assert [s["shard"] for s in shards] == ["1/3", "2/3", "3/3"]
    assert sum(s["samples"] for s in shards) == 64
    invoke("merge", tmp_path / "s3.json", tmp_path / "s1.json", tmp_path / "s2.json", "-o", tmp_path / "merged.json")
    whole = json.loads((tmp_path / "all.json").read_text())
    merged = json.loads((tmp_path / "merged.json").read_text())
    if observer != "mean_std":  # float sums depend on the order of addition; the rest is exact
        assert merged == whole
    invoke("quantize", model, "--stats", tmp_path / "all.json", "-o", tmp_path / "a.onnx")
    invoke("quantize", model, "--stats", tmp_path / "merged.json", "-o", tmp_path / "b.onnx")
    if observer == "mean_std":
        return
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_bad_shard_and_mismatched_merges_are_clear_errors(tmp_path):
    r = runner.invoke(app, ["calibrate", str(sample("mlp")), str(calib_dir("mlp")), "-o", "x.json", "--shard", "4/3"])
    assert r.exit_code == 2 and "--shard expects K/N" in r.stderr
    invoke("calibrate", sample("mlp"), calib_dir("mlp"), "-o", tmp_path / "a.json", "--limit", "4")
    invoke("calibrate", sample("cnn"), calib_dir("cnn"), "-o", tmp_path / "b.json", "--limit", "4")
    r = runner.invoke(
        app, ["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(tmp_path / "m.json")]
    )
    assert r.exit_code == 2 and "different models" in r.stderr
    assert not (tmp_path / "m.json").exists()
    invoke(
        "calibrate", sample("mlp"), calib_dir("mlp"), "-o", tmp_path / "c.json", "--limit", "4", "--observer", "minmax"
    )
    r = runner.invoke(
        app, ["merge", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "-o", str(tmp_path / "m.json")]
    )
    assert r.exit_code == 2 and "cannot merge" in r.stderr


def test_the_same_shard_twice_is_refused(tmp_path):
    invoke("calibrate", sample("mlp"), calib_dir("mlp"), "-o", tmp_path / "s1.json", "--shard", "1/2")
    r = runner.invoke(
        app, ["merge", str(tmp_path / "s1.json"), str(tmp_path / "s1.json"), "-o", str(tmp_path / "m.json")]
    )
    assert r.exit_code == 2 and "shard 1/2 is given twice" in r.stderr
