"""qtool.system.environment and stages: what the numbers depend on, and each stage's duration."""

from __future__ import annotations

import logging
import resource

import pytest

from qtool.system.environment import files_digest, int8_kernels_saturate, versions
from qtool.system.stages import peak_rss_mb, stage


def test_a_dataset_digest_follows_names_and_contents_not_order(tmp_path):
    for name, data in (("a.npy", b"1"), ("b.npy", b"2")):
        (tmp_path / name).write_bytes(data)
    files = [tmp_path / "b.npy", tmp_path / "a.npy"]
    first = files_digest(files)
    assert first == files_digest(list(reversed(files)))
    (tmp_path / "a.npy").write_bytes(b"3")
    assert files_digest(files) != first
    (tmp_path / "a.npy").write_bytes(b"1")
    (tmp_path / "a.npy").rename(tmp_path / "c.npy")
    assert files_digest([tmp_path / "b.npy", tmp_path / "c.npy"]) != first


def test_int8_kernels_saturate_only_on_x86_without_vnni():
    assert int8_kernels_saturate(["avx2", "fma"], "x86_64")
    assert not int8_kernels_saturate(["avx2", "avx512_vnni"], "x86_64")
    assert not int8_kernels_saturate(["avx2", "avx_vnni"], "AMD64")
    assert not int8_kernels_saturate(["asimd"], "aarch64")


def test_versions_name_what_the_numbers_depend_on():
    import onnxruntime

    found = versions()
    assert set(found) == {"qtool", "onnx", "onnxruntime", "numpy", "python"}
    assert found["onnxruntime"] == onnxruntime.__version__


def test_a_stage_logs_its_duration_and_the_peak_memory():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("qtool")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with stage("calibrate"):
            block = bytearray(32 << 20)  # 32 MB, touched
            block[::4096] = b"x" * len(block[::4096])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    messages = [r.getMessage() for r in records]
    assert messages[0] == "calibrate ..."
    assert messages[1].startswith("calibrate: ") and " s (peak memory so far " in messages[1]
    # the peak read from /proc agrees with the kernel's own accounting of this process (ru_maxrss, in KiB on Linux)
    kernel = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peak_rss_mb() == pytest.approx(kernel, rel=0.01)
