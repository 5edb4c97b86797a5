"""Hostile statistics, configs, samples and names: one clear line, exit 2, nothing written, no hang.

One test class per finding of the hostile-input campaign (see the README's robustness section).
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, sample

runner = CliRunner()
CNN, CALIB = sample("cnn"), calib_dir("cnn")


def _fails_cleanly(args: list[str], needle: str, *, outputs: tuple[Path, ...] = ()) -> str:
    """Exit 2, one ``error:`` line containing ``needle``, no traceback, no output written."""
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.output
    assert "Traceback" not in r.output
    assert not any(p.exists() for p in outputs)
    return errors[0]


@pytest.fixture(scope="module")
def stats_document(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("stats")
    r = runner.invoke(app, ["calibrate", str(CNN), str(CALIB), "-o", str(folder / "s.json"), "--limit", "8"])
    assert r.exit_code == 0, r.output
    return json.loads((folder / "s.json").read_text())


def _quantize_with(tmp_path: Path, document: dict | str, needle: str) -> None:
    stats = tmp_path / "hostile.json"
    stats.write_text(document if isinstance(document, str) else json.dumps(document))
    out = tmp_path / "q.onnx"
    _fails_cleanly(["quantize", CNN, "--stats", stats, "-o", out, "--no-search"], needle, outputs=(out,))


# -- 1. a statistics file never chooses code to run --------------------------------------------------


def test_a_module_path_in_a_stats_file_is_never_imported(tmp_path, stats_document, monkeypatch):
    canary = tmp_path / "evil_observer.py"
    canary.write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    document = copy.deepcopy(stats_document)
    for entry in document["tensors"].values():
        entry["observer"] = "evil_observer:Observer"
    _quantize_with(tmp_path, document, "names a Python module")
    merge_out = tmp_path / "m.json"
    (tmp_path / "b.json").write_text(json.dumps(document))
    _fails_cleanly(["merge", tmp_path / "hostile.json", tmp_path / "b.json", "-o", merge_out], "names a Python module")
    assert not (tmp_path / "RAN").exists()


def test_a_module_path_the_stats_file_names_stays_silent_on_stdout(tmp_path, stats_document):
    """``this:Observer`` would print the Zen of Python into ``--json -``."""
    document = copy.deepcopy(stats_document)
    next(iter(document["tensors"].values()))["observer"] = "this:Observer"
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps(document))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(CNN),
            "--stats",
            str(stats),
            "-o",
            str(tmp_path / "q.onnx"),
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == "" and "Zen of Python" not in proc.stderr


# -- 7. hand-edited statistics -----------------------------------------------------------------------


def _first(document: dict) -> dict:
    return next(iter(document["tensors"].values()))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: _first(d)["state"].update(min=[0.0, 1.0]), "per-tensor range must be one number"),
        (lambda d: _first(d)["state"].update(min=5.0, max=1.0), "min > max"),
        (lambda d: _first(d)["state"].update(min=float("nan")), "NaN"),
        (lambda d: _first(d)["state"].update(min="low"), "malformed statistics"),
        (lambda d: d.update(shard="x/y"), "'shard'"),
        (lambda d: d.update(shard=[1, 2]), "'shard'"),
        (lambda d: d.update(samples=-3), "'samples'"),
        (lambda d: d.update(samples=0), "0 samples"),
        (lambda d: d.update(tensors=[1, 2]), "'tensors'"),
        (lambda d: _first(d).update(axis="zero"), ".axis'"),
        (lambda d: _first(d).update(state=[1]), ".state': Input should be a valid dictionary"),
        (lambda d: d.update(model_sha256=12), "'model_sha256'"),
    ],
)
def test_hand_edited_statistics_are_refused_naming_the_field(tmp_path, stats_document, edit, needle):
    document = copy.deepcopy(stats_document)
    edit(document)
    _quantize_with(tmp_path, document, needle)


def test_deeply_nested_json_is_refused(tmp_path):
    _quantize_with(tmp_path, "[" * 100_000 + "]" * 100_000, "nests deeper")


def test_merging_shards_with_different_channel_counts_is_refused(tmp_path, stats_document):
    a, b = copy.deepcopy(stats_document), copy.deepcopy(stats_document)
    a["shard"], b["shard"] = "1/2", "2/2"
    for document, channels in ((a, 3), (b, 4)):
        for entry in document["tensors"].values():
            entry["observer"], entry["options"], entry["axis"] = "minmax", {}, 1
            entry["state"] = {"min": [-1.0] * channels, "max": [1.0] * channels}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "m.json"
    _fails_cleanly(["merge", tmp_path / "a.json", tmp_path / "b.json", "-o", out], "cannot merge", outputs=(out,))


def test_merging_moving_averages_of_no_batches_is_refused(tmp_path):
    folder = tmp_path
    for name in ("a", "b"):
        r = runner.invoke(
            app,
            [
                "calibrate",
                str(CNN),
                str(CALIB),
                "-o",
                str(folder / f"{name}.json"),
                "--limit",
                "2",
                "--observer",
                "moving_average",
            ],
        )
        assert r.exit_code == 0, r.output
        document = json.loads((folder / f"{name}.json").read_text())
        for entry in document["tensors"].values():
            entry["state"]["batches"] = 0
        (folder / f"{name}.json").write_text(json.dumps(document))
    out = folder / "m.json"
    _fails_cleanly(["merge", folder / "a.json", folder / "b.json", "-o", out], "0 batches", outputs=(out,))


# -- 7/9. configs: sizes, devices, FIFOs, numbers, patterns ------------------------------------------


def test_a_device_as_config_is_refused_at_once(tmp_path):
    out = tmp_path / "s.json"
    started = time.monotonic()
    _fails_cleanly(["calibrate", CNN, CALIB, "-c", "/dev/zero", "-o", out], "is a device", outputs=(out,))
    assert time.monotonic() - started < 10


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_as_config_or_sample_never_blocks(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, CALIB, "-c", fifo, "-o", out], "is a FIFO", outputs=(out,))
    data = tmp_path / "data"
    shutil.copytree(CALIB, data)
    os.mkfifo(data / "zzz.npy")
    _fails_cleanly(["calibrate", CNN, data, "-o", out], "is a FIFO", outputs=(out,))


def test_an_oversized_config_is_refused_before_reading(tmp_path):
    config = tmp_path / "big.yaml"
    with open(config, "wb") as f:
        f.truncate(64 << 20)
    _fails_cleanly(["inspect", CNN, "-c", config], "over the")


def test_an_astronomical_block_size_is_a_config_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("global:\n  weight: {granularity: per_block, block_size: 100000000000000000000}\n")
    _fails_cleanly(["inspect", CNN, "-c", config], "c.yaml:2")


def test_a_backtracking_pattern_against_a_long_node_name_finishes_at_once(tmp_path):
    model = onnx.load(str(CNN))
    model.graph.node[0].name = "a" * 50_000 + "!"
    path = tmp_path / "long.onnx"
    onnx.save(model, path)
    config = tmp_path / "c.yaml"
    config.write_text("exclude: ['re:(a+)+$']\n")
    result: dict[str, object] = {}

    def run() -> None:
        result["r"] = runner.invoke(app, ["inspect", str(path), "-c", str(config), "--json", str(tmp_path / "i.json")])

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "matching ran for more than 30 s"
    assert result["r"].exit_code == 0, result["r"].output  # type: ignore[attr-defined]


# -- 6. hostile samples ------------------------------------------------------------------------------


def _npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


def _data_dir(tmp_path: Path, files: dict[str, bytes]) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def _npz(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=method) as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        ({"a.npy": _npy_header((1 << 20, 1 << 20, 1 << 20)) + b"\0" * 16}, "more than the model"),
        ({"a.npy": _npy_header((1, 3, 32, 32)) + b"\0" * 16}, "declares"),
        ({"a.npy": _npy_header((2,), "|O") + b"\0" * 16}, "Python objects"),
        ({"a.npz": _npz({"input.txt": b"hello"})}, "is not a .npy array"),
        (
            {"a.npz": _npz({"input.npy": _npy_bytes(np.zeros((3, 32, 32), np.float32))}, zipfile.ZIP_BZIP2)},
            "compression method",
        ),
        ({"a.npz": b"PK\x03\x04 not really a zip"}, "cannot read sample archive"),
    ],
)
def test_hostile_npy_and_npz_samples_are_refused_without_allocating(tmp_path, files, needle):
    data = _data_dir(tmp_path, files)
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, data, "-o", out], needle, outputs=(out,))


def test_an_npz_zip_bomb_is_refused_by_its_declared_size(tmp_path, monkeypatch):
    """A member that inflates 1000-fold past the limit (lowered to 1 MiB here): refused before inflating."""
    import qtool.calibration.samples

    monkeypatch.setattr(qtool.calibration.samples, "SAMPLE_MAX_BYTES", 1 << 20)
    bomb = _npz({"input.npy": _npy_bytes(np.zeros(64 << 20, np.uint8))}, zipfile.ZIP_DEFLATED)
    assert len(bomb) < 1 << 20
    data = _data_dir(tmp_path, {"a.npz": bomb})
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, data, "-o", out], "unpacks to", outputs=(out,))


def _test_data_set(tmp_path: Path, tensor: TensorProto) -> Path:
    folder = tmp_path / "data" / "test_data_set_0"
    folder.mkdir(parents=True)
    (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    return folder.parent


def test_a_sample_tensor_with_external_data_is_refused(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.ones((3, 32, 32), np.float32).tobytes())
    tensor = TensorProto(name="input", data_type=TensorProto.FLOAT, dims=[1, 3, 32, 32])
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", str(secret)
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, _test_data_set(tmp_path, tensor), "-o", out], "external data", outputs=(out,))


def test_a_sample_tensor_of_unknown_type_is_refused(tmp_path):
    tensor = numpy_helper.from_array(np.zeros((1, 3, 32, 32), np.float32), "input")
    tensor.data_type = 99
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, _test_data_set(tmp_path, tensor), "-o", out], "data_type 99", outputs=(out,))


def test_an_image_over_the_decompression_bomb_limit_is_refused_without_warning_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 32 * 32)  # a 48x48 image is "large", 64x64 a "bomb"
    for size, name in ((48, "large"), (64, "bomb")):
        data = tmp_path / name
        data.mkdir()
        Image.new("RGB", (size, size)).save(data / "a.png")
        out = tmp_path / f"{name}.json"
        line = _fails_cleanly(["calibrate", CNN, data, "-o", out], "decompression-bomb limit", outputs=(out,))
        assert "DecompressionBombWarning" not in line


def test_images_for_a_model_whose_input_is_not_an_image_are_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.ones((8, 4), np.float32), "w")],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "images"
    data.mkdir()
    Image.new("RGB", (8, 8)).save(data / "a.png")
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", model, data, "-o", out], "images need a model input of rank", outputs=(out,))


# -- 10. exit 0 with nothing usable ------------------------------------------------------------------


def test_calibrating_when_every_sample_is_skipped_is_an_error(tmp_path):
    data = _data_dir(tmp_path, {f"{i}.npy": _npy_bytes(np.full((3, 32, 32), np.nan, np.float32)) for i in range(3)})
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, data, "-o", out, "--skip-nonfinite"], "3 skipped", outputs=(out,))


# -- 8. names with terminal control characters -------------------------------------------------------

HOSTILE_NAME = "conv\x1b]0;owned\x07\x1b[2J\nerror: fake line [bold red]x[/bold red]"


def test_control_characters_in_names_never_reach_the_terminal_raw(tmp_path):
    model = onnx.load(str(CNN))
    model.graph.node[0].name = HOSTILE_NAME
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    r = runner.invoke(app, ["inspect", str(path), "--json", str(tmp_path / "i.json")])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output
    # escaped, visibly (tables may cut the name at the terminal's width)
    assert "\\x1b]0;ow" in r.output and not any(line.startswith("error: fake") for line in r.output.splitlines())
    assert "[bold" in r.output  # markup shown as text, not applied as style
    names = [row["name"] for row in json.loads((tmp_path / "i.json").read_text())["nodes"]]
    assert HOSTILE_NAME in names  # JSON keeps the exact name

    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"node_name": {HOSTILE_NAME + "2": None}}))
    line = _fails_cleanly(["inspect", path, "-c", config], "matches no node")
    assert "\x1b" not in line and "\\n" in line


# -- findings of the independent hostile campaign ----------------------------------------------------


def _entry(observer: str, options: dict, state: dict) -> dict:
    return {"observer": observer, "axis": None, "options": options, "state": state}


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        (_entry("mean_std", {}, {"count": -5, "sum": 1.0, "sum_sq": 1.0, "min": -1.0, "max": 1.0}), "has no value"),
        (
            _entry(
                "percentile",
                {},
                {
                    "histogram": {"bins": 2048, "channels": 100_000_000, "radius": 1.0, "index": [], "count": []},
                    "min": -1.0,
                    "max": 1.0,
                },
            ),
            "channels",
        ),
        (_entry("entropy", {"bins": 1 << 20}, {}), "at most 16384 bins"),
        (_entry("mse", {"candidates": 2_000_000_000}, {}), "candidates <= 10000"),
        (
            {"observer": "minmax", "axis": 0, "options": {}, "state": {"min": [-1, -2, -3], "max": [1, 2, 3]}},
            "per channel",
        ),
        (_entry("minmax", {}, {"min": [[[-1.0]]], "max": [[[1.0]]]}), "one number"),
    ],
)
def test_hostile_observer_states_in_statistics_are_refused(tmp_path, stats_document, entry, needle):
    document = copy.deepcopy(stats_document)
    name = next(iter(document["tensors"]))
    document["tensors"][name] = entry
    _quantize_with(tmp_path, document, needle)


def test_a_json_integer_of_thousands_of_digits_is_refused(tmp_path, stats_document):
    text = json.dumps(stats_document).replace(f'"samples": {stats_document["samples"]}', '"samples": 1' + "0" * 5000)
    _quantize_with(tmp_path, text, "digits")


def test_a_sparse_npy_claiming_gigabytes_is_refused_before_allocating(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    path = data / "a.npy"
    with open(path, "wb") as f:
        f.write(_npy_header((1 << 30,), "<f4"))
        f.truncate(f.tell() + (1 << 32))  # 4 GiB of zeros that take no disk
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, data, "-o", out], "bytes, over the", outputs=(out,))


def test_a_valid_tensor_proto_sample_calibrates_under_a_4_gib_address_space(tmp_path):
    tensor = numpy_helper.from_array(np.zeros((1, 3, 32, 32), np.float32), "input")
    data = _test_data_set(tmp_path, tensor)
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from qtool.cli import main\n"
        f"main(['calibrate', {str(CNN)!r}, {str(data)!r}, '-o', {str(tmp_path / 's.json')!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--shard", "²/³"], "--shard expects K/N"),
        (["--observer-option", "x=[1"], "not a YAML scalar"),
        (["--observer-option", "bins=!!python/name:os.system"], "not a YAML scalar"),
    ],
)
def test_hostile_option_values_are_one_line_errors(tmp_path, args, needle):
    out = tmp_path / "s.json"
    _fails_cleanly(["calibrate", CNN, CALIB, "-o", out, *args], needle, outputs=(out,))


def test_huge_thread_counts_and_image_sizes_are_usage_errors(tmp_path):
    r = runner.invoke(app, ["compare", str(CNN), str(CNN), "--data", str(CALIB), "--threads", "2147483648"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    config = tmp_path / "c.yaml"
    config.write_text("preprocess: {resize: [200000, 200000]}\n")
    _fails_cleanly(["inspect", CNN, "-c", config], "from 1 to 16384")


def test_usage_errors_from_the_console_script_are_one_line():
    qtool_script = Path(sys.executable).with_name("qtool")
    for args in (["calibrate"], ["inspect", str(CNN), "--bogus"], ["quantize", str(CNN), "--batch-size", "0"]):
        proc = subprocess.run([str(qtool_script), *args], capture_output=True, text=True, timeout=60, check=False)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr


def test_numpy_warnings_never_reach_stderr(tmp_path):
    data = tmp_path / "images"
    data.mkdir()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(data / "a.png")
    config = tmp_path / "c.yaml"
    config.write_text("preprocess: {mean: [1.0e+300, 1, 1]}\n")
    qtool_script = Path(sys.executable).with_name("qtool")
    proc = subprocess.run(
        [str(qtool_script), "calibrate", str(CNN), str(data), "-c", str(config), "-o", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
