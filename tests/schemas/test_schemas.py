"""The JSON Schemas `qtool schema` prints hold for every shipped config and every report qtool writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from qtool.cli import app
from qtool.schemas import SCHEMA_NAMES
from tests.conftest import ROOT, calib_dir, eval_dir, sample

runner = CliRunner()


def _schema(name: str) -> dict[str, Any]:
    r = runner.invoke(app, ["schema", name])
    assert r.exit_code == 0, r.output
    schema = json.loads(r.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _valid(document: Any, name: str) -> None:
    jsonschema.Draft202012Validator(_schema(name)).validate(document)


def _invalid(document: Any, name: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        _valid(document, name)


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_schema_is_a_valid_json_schema(name):
    assert _schema(name)["$id"] == f"qtool:{name}"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_matches_the_config_schema(path):
    _valid(yaml.safe_load(path.read_text()) or {}, "config")


def test_the_config_schema_refuses_what_load_config_refuses():
    _invalid({"global": {"weight": {"dtype": "int3"}}}, "config")
    _invalid({"global": {"weight": {"dtyp": "int8"}}}, "config")
    _invalid({"calibration": {"batch_size": 0}}, "config")
    _invalid({"version": 2}, "config")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("reports")
    cnn = sample("cnn")
    commands = {
        "calibrate": ["calibrate", cnn, calib_dir("cnn"), "-o", out / "s.json", "--json", out / "calibrate.json"],
        "quantize": [
            "quantize",
            cnn,
            "--data",
            calib_dir("cnn"),
            "-o",
            out / "q.onnx",
            "--json",
            out / "quantize.json",
        ],
        "compare": [
            "compare",
            cnn,
            out / "q.onnx",
            "--data",
            eval_dir("cnn"),
            "--per-layer",
            "--runs",
            "3",
            "--fail-under",
            "sqnr=10",
            "--max-latency-ratio",
            "100",
            "--json",
            out / "compare.json",
        ],
        "inspect": ["inspect", cnn, "--data", calib_dir("cnn"), "--json", out / "inspect.json"],
        "doctor": ["doctor", "--json", out / "doctor.json"],
        "tune": [
            "tune",
            sample("mlp"),
            "--data",
            calib_dir("mlp"),
            "--eval",
            eval_dir("mlp"),
            "--target-sqnr",
            "30",
            "-o",
            out / "t.onnx",
            "--config-out",
            out / "t.yaml",
            "--json",
            out / "tune.json",
        ],
    }
    for command in commands.values():
        r = runner.invoke(app, [str(a) for a in command])
        assert r.exit_code == 0, r.output
    return {"stats": out / "s.json", **{name: out / f"{name}.json" for name in commands}}


@pytest.mark.parametrize(
    ("report", "schema"),
    [
        ("stats", "stats"),
        ("calibrate", "calibrate-report"),
        ("quantize", "quantize-report"),
        ("compare", "compare-report"),
        ("inspect", "inspect-report"),
        ("tune", "tune-report"),
        ("doctor", "doctor-report"),
    ],
)
def test_written_files_match_their_schema(reports, report, schema):
    document = json.loads(reports[report].read_text())
    _valid(document, schema)
    if report == "quantize":
        assert document["comparison"] is not None  # --data: the nested compare report is checked too
    if report == "compare":
        assert document["per_layer"]["layers"] and document["gates"]["results"]
    document["unexpected"] = 1
    _invalid(document, schema)  # no key a schema does not describe


def test_an_unknown_schema_name_is_a_usage_error():
    r = runner.invoke(app, ["schema", "nope"])
    assert r.exit_code == 2 and "choose one of" in r.output
