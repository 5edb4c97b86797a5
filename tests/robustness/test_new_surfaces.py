"""The robustness promises on the newer surfaces: tune's cache, metric and labels, baselines, shapes,
TensorRT files, dataset URLs, Dask schedulers, doctor.

One test per class of finding (issue 34): a bad input is one clear line and exit 2 (or, for the tune
cache, a warning and a fresh measurement), nothing is written, nothing hangs, and exit 70 stays for bugs.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from qtool.cli import app
from qtool.reports.documents import to_json
from qtool.system.files import read_json
from tests.conftest import calib_dir, eval_dir, sample

runner = CliRunner()
CNN, CALIB = sample("cnn"), calib_dir("cnn")
MLP = sample("mlp")


def _clean_failure(args: list, needle: str, outputs: tuple[Path, ...] = ()) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.output
    assert "Traceback" not in r.output
    assert not any(p.exists() for p in outputs)
    return errors[0]


def _tune_args(tmp_path: Path, *extra) -> list:
    return [
        *("tune", MLP, "--data", calib_dir("mlp"), "--eval", eval_dir("mlp")),
        *("-o", tmp_path / "out.onnx", "--config-out", tmp_path / "chosen.yaml", *extra),
    ]


class TestJsonFiles:
    """One reader for every JSON file: depth, size and finite numbers, a clear error naming the file."""

    @pytest.mark.parametrize(
        ("text", "needle"),
        [
            ("[" * 100_000 + "]" * 100_000, "nests deeper than"),
            ('{"a": 1e400}', "too large for a float"),
            ('{"a": NaN}', "not a JSON number"),
            ('{"a": -Infinity}', "not a JSON number"),
        ],
    )
    def test_hostile_documents_are_refused_naming_the_file(self, tmp_path, text, needle):
        path = tmp_path / "doc.json"
        path.write_text(text)
        with pytest.raises(Exception, match=needle) as caught:
            read_json(path, "some file", 1 << 30)
        assert str(path) in str(caught.value) and type(caught.value).__name__ == "QtoolError"

    def test_a_fifo_is_refused_without_blocking(self, tmp_path):
        fifo = tmp_path / "doc.json"
        os.mkfifo(fifo)
        with pytest.raises(Exception, match="is a FIFO"):
            read_json(fifo, "some file", 1 << 20)

    def test_reports_never_hold_nan_or_infinity(self):
        text = to_json({"a": float("inf"), "b": [1.0, float("nan")], "c": {"d": -float("inf")}})
        assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}}

    def test_a_baseline_with_nan_is_refused_not_passed(self, tmp_path):
        report = tmp_path / "base.json"
        r = runner.invoke(
            app, ["compare", str(CNN), str(CNN), "--data", str(CALIB), "--limit", "2", "--runs", "0", "--json", report]
        )
        assert r.exit_code == 0, r.output
        report.write_text(
            report.read_text().replace('"sqnr_db": null', '"sqnr_db": NaN', 1).replace(": 1.0,", ": NaN,", 1)
        )
        _clean_failure(
            [
                "compare",
                CNN,
                CNN,
                "--data",
                CALIB,
                "--limit",
                "2",
                "--runs",
                "0",
                "--baseline",
                report,
                "--fail-on-regression",
            ],
            "not a JSON number",
        )


class TestTuneCache:
    """A bad cache file of any kind is skipped with a warning and measured anew, never an error or a hang."""

    @pytest.fixture
    def cache(self, tmp_path, monkeypatch):
        folder = tmp_path / "cache"
        monkeypatch.setenv("QTOOL_CACHE_DIR", str(folder))
        return folder

    def _kept(self, tmp_path: Path, cache: Path) -> Path:
        r = runner.invoke(app, [str(a) for a in _tune_args(tmp_path, "--target-sqnr", "30")])
        assert r.exit_code == 0, r.output
        (kept,) = cache.rglob("sensitivity-*.json")
        return kept

    def _measured_anew(self, tmp_path: Path) -> None:
        r = runner.invoke(app, [str(a) for a in _tune_args(tmp_path, "--target-sqnr", "30", "--json", "-")])
        assert r.exit_code == 0, r.output
        assert "Traceback" not in r.output
        document = json.loads(r.stdout)
        assert not document["sensitivity"]["cached"]

    @pytest.mark.parametrize(
        "damage",
        ["deep", "huge number", "unknown node", "empty", "negative", "fifo"],
    )
    def test_damaged_cache_files_are_measured_anew(self, tmp_path, cache, damage):
        kept = self._kept(tmp_path, cache)
        document = json.loads(kept.read_text())
        node = next(iter(document["nsr"]))
        if damage == "deep":
            kept.write_text("[" * 100_000 + "]" * 100_000)
        elif damage == "huge number":
            kept.write_text(json.dumps(document).replace(json.dumps(document["seconds"]), "1e400", 1))
        elif damage == "unknown node":
            document["nsr"]["no such node"] = document["nsr"].pop(node)
            kept.write_text(json.dumps(document))
        elif damage == "empty":
            document["nsr"], document["measured"] = {}, {}
            kept.write_text(json.dumps(document))
        elif damage == "negative":
            first = next(iter(document["nsr"][node]))
            document["nsr"][node][first] = -1.0
            kept.write_text(json.dumps(document))
        else:
            kept.unlink()
            os.mkfifo(kept)
        finished: list[bool] = []
        worker = threading.Thread(target=lambda: (self._measured_anew(tmp_path), finished.append(True)))
        worker.start()
        worker.join(120)
        assert finished == [True], "tune hung or failed on a damaged cache file"
        if damage == "fifo":
            assert stat.S_ISFIFO(kept.stat().st_mode) or kept.is_file()


METRICS = """
import sys


def infinite(reference, candidate):
    return float("inf")


def exits(reference, candidate):
    sys.exit(0)
"""


class TestMetricAndLabels:
    def test_a_non_finite_metric_is_an_error_naming_it(self, tmp_path, monkeypatch):
        (tmp_path / "hostile_metric.py").write_text(METRICS)
        monkeypatch.chdir(tmp_path)
        args = _tune_args(tmp_path, "--metric", "hostile_metric:infinite", "--target-metric", "1", "--json", "-")
        error = _clean_failure(args, "--metric hostile_metric:infinite returned inf", (tmp_path / "out.onnx",))
        assert "finite" in error or "returned inf" in error

    def test_a_metric_that_exits_is_an_error_naming_it(self, tmp_path, monkeypatch):
        (tmp_path / "exiting_metric.py").write_text(METRICS)
        monkeypatch.chdir(tmp_path)
        args = _tune_args(tmp_path, "--metric", "exiting_metric:exits", "--target-metric", "1")
        _clean_failure(args, "it called sys.exit(0)", (tmp_path / "out.onnx",))

    def test_labels_as_a_single_value_are_refused(self, tmp_path, monkeypatch):
        (tmp_path / "m.py").write_text("def f(r, c, label):\n    return 1.0\n")
        monkeypatch.chdir(tmp_path)
        labels = tmp_path / "labels.npy"
        np.save(labels, np.array(3))
        args = _tune_args(tmp_path, "--metric", "m:f", "--target-metric", "0", "--labels", labels)
        _clean_failure(args, "a 0-d array", (tmp_path / "out.onnx",))

    def test_an_npy_header_claiming_gigabytes_is_refused_before_allocation(self, tmp_path, monkeypatch):
        (tmp_path / "m.py").write_text("def f(r, c, label):\n    return 1.0\n")
        monkeypatch.chdir(tmp_path)
        labels = tmp_path / "labels.npy"
        header = "{'descr': '<f8', 'fortran_order': False, 'shape': (1500000000,), }"
        header = header + " " * (118 - len(header)) + "\n"
        labels.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\0" * 64)
        args = _tune_args(tmp_path, "--metric", "m:f", "--target-metric", "0", "--labels", labels)
        _clean_failure(args, "--labels", (tmp_path / "out.onnx",))


class TestInputShapes:
    @pytest.mark.parametrize(
        ("shape", "needle"),
        [
            ("x:1x16x99999999999999999999x1", "over 2,147,483,647"),
            ("x:1x3x100000x100000", "values per sample, more than"),
        ],
    )
    def test_impossible_sizes_are_refused_before_any_allocation(self, tmp_path, shape, needle):
        out = tmp_path / "s.json"
        _clean_failure(["calibrate", CNN, CALIB, "-o", out, "--input-shapes", shape], needle, (out,))
        _clean_failure(["compare", CNN, CNN, "--data", CALIB, "--input-shapes", shape], needle)

    def test_an_image_folder_is_never_resized_past_memory(self, tmp_path):
        from PIL import Image

        model = tmp_path / "huge_input.onnx"
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 40000, 40000])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 40000, 40000])
        w = helper.make_tensor("w", TensorProto.FLOAT, [1, 3, 1, 1], [0.5, 0.25, 0.125])
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g", [x], [y], [w])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
        images = tmp_path / "images"
        images.mkdir()
        Image.new("RGB", (8, 8)).save(images / "a.png")
        out = tmp_path / "s.json"
        _clean_failure(["calibrate", model, images, "-o", out], "more than 268,435,456 pixels", (out,))


class TestTensorRTFiles:
    def _model_with_name(self, tmp_path: Path, name: str) -> Path:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
        nodes = [helper.make_node("Relu", ["x"], [name]), helper.make_node("Relu", [name], ["y"])]
        graph = helper.make_graph(nodes, "g", [x], [y])
        path = tmp_path / "named.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        data = tmp_path / "data"
        data.mkdir()
        np.save(data / "a.npy", np.ones((1, 4), np.float32))
        return path

    def test_a_name_with_a_line_break_cannot_forge_cache_lines(self, tmp_path):
        model = self._model_with_name(tmp_path, "a\nforged: 3f800000")
        out, cache = tmp_path / "s.json", tmp_path / "trt.cache"
        _clean_failure(
            ["calibrate", model, tmp_path / "data", "-o", out, "--tensorrt-cache", cache],
            "control character",
            (out, cache),
        )

    def test_a_version_of_thousands_of_digits_is_refused(self, tmp_path):
        out, cache = tmp_path / "s.json", tmp_path / "trt.cache"
        args = ["calibrate", CNN, CALIB, "-o", out, "--tensorrt-cache", cache, "--tensorrt-version", "9" * 5000]
        _clean_failure(args, "is not major.minor[.patch]", (out, cache))

    def test_the_engine_folder_is_not_created_when_a_check_fails(self, tmp_path):
        engines = tmp_path / "engines" / "new"
        _clean_failure(
            [
                "compare",
                CNN,
                CNN,
                "--data",
                tmp_path / "missing",
                "--providers",
                "tensorrt",
                "--trt-engine-cache",
                engines,
            ],
            "missing",
        )
        assert not engines.exists() and not engines.parent.exists()


class TestUrls:
    def test_a_file_url_dataset_is_protected_like_a_path(self, tmp_path):
        data = tmp_path / "calib"
        data.mkdir()
        for path in sorted(CALIB.iterdir())[:4]:
            (data / path.name).write_bytes(path.read_bytes())
        first = sorted(data.iterdir())[0]
        before = first.read_bytes()
        _clean_failure(["calibrate", CNN, f"file://{data}", "-o", first], "never overwrites its inputs")
        assert first.read_bytes() == before


def _quick_failure(args: list[str], needle: str, seconds: float) -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "qtool", *args], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < seconds, done.stderr
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


class TestSchedulers:
    @pytest.fixture(autouse=True)
    def _dask(self) -> None:
        pytest.importorskip("distributed")

    def _calibrate(self, tmp_path: Path, scheduler: str) -> list[str]:
        return ["calibrate", str(CNN), str(CALIB), "-o", str(tmp_path / "s.json"), "--scheduler", scheduler]

    @pytest.mark.parametrize(
        ("address", "needle"),
        [
            ("garbage", "not an address of the form tcp://HOST:PORT"),
            ("tls://127.0.0.1:1", "TLS schedulers need certificates"),
            ("tcp://127.0.0.1:99999", "not an address of the form"),
        ],
    )
    def test_malformed_addresses_are_refused_at_once(self, tmp_path, address, needle):
        _quick_failure(self._calibrate(tmp_path, address), needle, 15)
        assert not (tmp_path / "s.json").exists()

    @pytest.mark.parametrize("reply", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\xff" * 64])
    def test_a_service_that_is_not_dask_is_named_quickly(self, tmp_path, reply):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]

        def serve() -> None:
            server.settimeout(30)
            try:
                while True:
                    connection, _ = server.accept()
                    if reply:
                        connection.sendall(reply)
                    time.sleep(0.5)
                    connection.close()
            except OSError:
                return

        threading.Thread(target=serve, daemon=True).start()
        try:
            _quick_failure(self._calibrate(tmp_path, f"tcp://127.0.0.1:{port}"), "does not answer as a Dask", 20)
        finally:
            server.close()

    def test_a_closed_port_is_named_quickly(self, tmp_path):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        _quick_failure(self._calibrate(tmp_path, f"tcp://127.0.0.1:{port}"), "cannot reach the Dask scheduler", 20)


def test_doctor_survives_a_gpu_tool_that_prints_bytes_not_utf8(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf 'GPU 0: \\377\\376 [bold]card\\n'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "qtool", "doctor"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "GPU 0:" in done.stdout and "\ufffd" in done.stdout and "Traceback" not in done.stderr


def test_names_cannot_forge_markdown_rows_or_break_junit_xml(tmp_path):
    import xml.etree.ElementTree as ET

    name = "y|z\n| forged | row |\x07"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], [name])], "g", [x], [y])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.ones((1, 4), np.float32))
    markdown, junit = tmp_path / "r.md", tmp_path / "r.xml"
    r = runner.invoke(
        app,
        [str(a) for a in ("compare", model, model, "--data", data, "--runs", "0", "--fail-under", "sqnr=20")]
        + ["--markdown", str(markdown), "--junit", str(junit)],
    )
    assert r.exit_code == 0, r.output
    lines = markdown.read_text().splitlines()
    assert not any(line.startswith("| forged") for line in lines)
    assert any("y\\|z" in line for line in lines)  # the name, escaped, in its own cell
    ET.fromstring(junit.read_text().split("\n", 1)[1])  # well-formed XML


def test_a_yaml_escape_past_unicode_is_a_config_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text('global: "\\U00110000"\n')
    _clean_failure(["inspect", CNN, "--config", config], "invalid YAML")
