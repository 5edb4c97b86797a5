"""A third-party observer package, installed from tests/plugins, used end to end through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, calib_dir, sample

PLUGIN = ROOT / "tests" / "plugins" / "qtool-plugin-example"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("plugin") / PLUGIN.name
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))  # builds leave files
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT)])
    return env


def qtool(env: dict[str, str], *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qtool", *map(str, args)], env=env, capture_output=True, text=True, check=False
    )


def test_installed_plugin_is_listed_without_breaking_on_a_broken_one(plugin_env):
    r = qtool(plugin_env, "observers", "--json", "-")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)["observers"]}
    assert rows["absmax_margin"]["source"] == "plugin (qtool-plugin-example)"
    assert "broken" in rows and "minmax" in rows


def test_plugin_observer_calibrates_and_quantizes_end_to_end(plugin_env, tmp_path):
    stats, out = tmp_path / "s.json", tmp_path / "q.onnx"
    r = qtool(
        plugin_env,
        "calibrate",
        sample("mlp"),
        calib_dir("mlp"),
        "-o",
        stats,
        "--observer",
        "absmax_margin",
        "--observer-option",
        "margin=1.5",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(stats.read_text())
    entry = data["tensors"]["input"]
    assert entry["observer"] == "absmax_margin" and entry["options"] == {"margin": 1.5}
    assert entry["state"]["absmax"] > 0
    r = qtool(plugin_env, "quantize", sample("mlp"), "--stats", stats, "-o", out)
    assert r.returncode == 0, r.stderr
    assert out.exists()


def test_module_class_reference_in_the_yaml_config(plugin_env, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("calibration:\n  observer: {name: 'qtool_plugin_example:AbsMaxMarginObserver', margin: 2}\n")
    r = qtool(
        plugin_env,
        "calibrate",
        sample("mlp"),
        calib_dir("mlp"),
        "-o",
        tmp_path / "s.json",
        "--config",
        config,
        "--limit",
        "4",
    )
    assert r.returncode == 0, r.stderr
    entry = json.loads((tmp_path / "s.json").read_text())["tensors"]["input"]
    assert entry["observer"] == "qtool_plugin_example:AbsMaxMarginObserver" and entry["options"] == {"margin": 2.0}


def test_a_broken_plugin_is_a_one_line_error_when_used(plugin_env, tmp_path):
    r = qtool(
        plugin_env, "calibrate", sample("mlp"), calib_dir("mlp"), "-o", tmp_path / "s.json", "--observer", "broken"
    )
    assert r.returncode == 2
    assert "observer plugin 'broken' failed to load" in r.stderr and "Traceback" not in r.stderr
    assert not Path(tmp_path / "s.json").exists()
