"""Calibration on Dask: a local cluster, and a scheduler with two workers started through Dask's CLI.

The statistics of the exactly mergeable observers must be byte for byte those of one process; a
sample that breaks a worker is named; Ctrl-C stops the workers; missing Dask and a scheduler that
cannot be reached are one-line errors.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import QtoolError
from qtool.options import CalibrationOptions
from tests.conftest import calib_dir, sample

pytest.importorskip("distributed", reason="the distributed extra is not installed")

runner = CliRunner()
DASK = Path(sys.executable).with_name("dask")


def _cli(*args: object) -> None:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("observer", ["entropy", "minmax"])
def test_local_workers_write_the_statistics_file_of_one_process(tmp_path, observer):
    model, data = sample("cnn"), calib_dir("cnn")
    _cli("calibrate", model, data, "-o", tmp_path / "one.json", "--observer", observer)
    _cli("calibrate", model, data, "-o", tmp_path / "two.json", "--observer", observer, "--workers", "2")
    assert (tmp_path / "two.json").read_bytes() == (tmp_path / "one.json").read_bytes()
    assert json.loads((tmp_path / "two.json").read_text())["samples"] == len(list(data.glob("*.npy")))


def _slow_work(steps: int, report) -> int:
    for _ in range(steps):
        time.sleep(0.2)
        report(1)
    return steps * 10


@pytest.mark.slow
def test_the_engine_reports_progress_while_the_workers_run():
    from qtool.distributed import EngineSpec, open_engine

    units: list[int] = []
    with open_engine(EngineSpec(workers=2)) as engine:
        assert engine.workers == 2
        results = engine.run(_slow_work, [4, 3, 5], describe=str, on_progress=units.append)
    assert results == [40, 30, 50]  # in the order of the items
    assert sum(units) == 12 and len(units) >= 3  # heard while running, not only at the end


def test_progress_covers_every_sample_of_every_worker():
    reports: list[tuple[str, int]] = []
    units: list[int] = []

    def factory(description: str, total: int):
        reports.append((description, total))
        return units.append

    stats = qtool.calibrate(
        sample("mlp"), calib_dir("mlp"), options=CalibrationOptions(workers=2, limit=12), progress=factory
    )
    assert stats.samples == 12
    assert reports == [("calibrating on 2 workers", 12)]
    assert sum(units) == 12


def test_shard_and_workers_together_are_refused():
    with pytest.raises(QtoolError, match="--shard and --workers"):
        qtool.calibrate(sample("mlp"), calib_dir("mlp"), options=CalibrationOptions(workers=2, shard=(1, 2)))


def _breaks_on_long_rows(path: Path) -> Path:
    """A model reshaping its [1, N] input to [1, 4, 2]: any sample with N != 8 fails inside onnxruntime."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [1, 4, 2])
    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1.0, 0.5, -0.5, 1.0])
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape")]
    nodes.append(helper.make_node("MatMul", ["r", "w"], ["y"], name="matmul"))
    graph = helper.make_graph(nodes, "g", [x], [y], [shape, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_sample_that_breaks_a_worker_is_named(tmp_path):
    model = _breaks_on_long_rows(tmp_path / "model.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        np.save(data / f"{i:02d}.npy", rng.normal(size=(1, 8 if i != 3 else 6)).astype(np.float32))
    with pytest.raises(QtoolError, match=r"03\.npy") as caught:
        qtool.calibrate(model, data, options=CalibrationOptions(workers=2))
    assert "onnxruntime failed running the float model on sample" in str(caught.value)


def test_without_dask_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    result = runner.invoke(
        app, ["calibrate", str(sample("mlp")), str(calib_dir("mlp")), "-o", str(tmp_path / "s.json"), "--workers", "2"]
    )
    assert result.exit_code == 2
    assert "need Dask distributed" in result.stderr and "qtool-onnx[distributed]" in result.stderr
    assert not (tmp_path / "s.json").exists()


def test_an_unreachable_scheduler_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setattr("qtool.distributed.dask_engine.CONNECT_SECONDS", 2)
    result = runner.invoke(
        app,
        [
            "calibrate",
            str(sample("mlp")),
            str(calib_dir("mlp")),
            "-o",
            str(tmp_path / "s.json"),
            "--scheduler",
            "tcp://127.0.0.1:9",
        ],
    )
    assert result.exit_code == 2
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in result.stderr
    assert not (tmp_path / "s.json").exists()


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {seconds} s")
        time.sleep(0.2)


@pytest.fixture
def scheduler(tmp_path):
    """A Dask scheduler and two single-threaded workers, started with Dask's own CLI on localhost."""
    if not DASK.exists():
        pytest.skip("the dask command is not installed next to this Python")
    address_file = tmp_path / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    started = [
        subprocess.Popen(
            [
                DASK,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                address_file,
            ],
            **quiet,
        )
    ]
    try:
        _wait_for(address_file, 60)
        for _ in range(2):
            started.append(
                subprocess.Popen(
                    [
                        DASK,
                        "worker",
                        "--scheduler-file",
                        address_file,
                        "--nthreads",
                        "1",
                        "--no-dashboard",
                        "--host",
                        "127.0.0.1",
                    ],
                    **quiet,
                )
            )
        yield json.loads(address_file.read_text())["address"]
    finally:
        for process in reversed(started):
            process.terminate()
        for process in started:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.mark.slow
def test_a_running_scheduler_gives_the_statistics_of_one_process(tmp_path, scheduler):
    from distributed import Client

    with Client(scheduler, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=60)
    model, data = sample("cnn"), calib_dir("cnn")
    _cli("calibrate", model, data, "-o", tmp_path / "one.json", "--observer", "entropy")
    _cli("calibrate", model, data, "-o", tmp_path / "sched.json", "--observer", "entropy", "--scheduler", scheduler)
    assert (tmp_path / "sched.json").read_bytes() == (tmp_path / "one.json").read_bytes()
    # a URL is read by the workers themselves (here file://, which every process on this machine sees)
    url = data.resolve().as_uri()
    _cli("calibrate", model, url, "-o", tmp_path / "url.json", "--observer", "entropy", "--scheduler", scheduler)
    assert (tmp_path / "url.json").read_bytes() == (tmp_path / "one.json").read_bytes()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").exists(), reason="walks /proc to find the worker processes")
def test_ctrl_c_stops_the_workers_and_writes_nothing(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    base = rng.normal(size=(1, 3, 32, 32)).astype(np.float32)
    for i in range(6000):  # several seconds of work even on a fast machine (2000 took 4 s on 2 cores)
        np.save(data / f"{i:04d}.npy", base + i * 1e-3)
    out = tmp_path / "stats.json"
    command = [sys.executable, "-m", "qtool", "calibrate", str(sample("cnn")), str(data), "-o", str(out)]
    process = subprocess.Popen(
        [*command, "--workers", "2", "--observer", "entropy"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    deadline = time.monotonic() + 90
    workers: set[int] = set()
    while len(workers) < 2 and time.monotonic() < deadline:  # the two worker processes
        time.sleep(0.2)
        workers = _descendants(process.pid)
    assert len(workers) >= 2 and process.poll() is None, "the local cluster did not start"
    time.sleep(1)
    workers = _descendants(process.pid)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr.decode()
    assert not out.exists()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)]
    assert "Traceback" not in stderr.decode()


def test_workers_calibrate_a_dataset_behind_a_url(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    for path in sorted(calib_dir("mlp").glob("*.npy")):
        memory.pipe(f"/qtool-workers/data/{path.name}", path.read_bytes())
    try:
        whole = qtool.calibrate(sample("mlp"), calib_dir("mlp"), options=CalibrationOptions(observer="entropy"))
        spread = qtool.calibrate(
            sample("mlp"), "memory://qtool-workers/data", options=CalibrationOptions(observer="entropy", workers=2)
        )
        assert spread.to_json() == whole.to_json()
    finally:
        memory.rm("/qtool-workers", recursive=True)


def _abandon_a_failed_task(fail: Callable[[], object]) -> None:
    """Runs a task that fails with ``fail``'s error and drops it unretrieved, as Dask does."""

    async def failing() -> None:
        fail()

    async def main() -> None:
        task = asyncio.ensure_future(failing())
        await asyncio.wait([task])

    asyncio.run(main())
    gc.collect()


def test_dask_own_abandoned_tasks_stay_quiet_others_are_still_logged(caplog):
    from distributed.utils import parse_ports

    from qtool.distributed.dask_engine import _drop_abandoned_dask_tasks

    _drop_abandoned_dask_tasks()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _abandon_a_failed_task(lambda: parse_ports("two"))  # raised inside Dask's own code
        assert "never retrieved" not in caplog.text
        _abandon_a_failed_task(lambda: int("two"))  # raised in anyone else's code
        assert "never retrieved" in caplog.text
