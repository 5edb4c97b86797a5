"""Peak memory of calibration must not grow with the number of samples (measured in subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, sample

CHILD = r"""
import json, sys
import qtool
from bench.measure import peak_rss_kb
stats = qtool.calibrate(sys.argv[1], sys.argv[2], options=qtool.CalibrationOptions(observer=sys.argv[3]))
print(json.dumps({"samples": stats.samples, "peak_rss_kb": peak_rss_kb()}))
"""


def measure_peak_kb(data_dir, observer: str) -> tuple[int, int]:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(sample("cnn")), str(data_dir), observer],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result = json.loads(r.stdout.strip().splitlines()[-1])
    return result["samples"], result["peak_rss_kb"]


@pytest.mark.parametrize("observer", ["minmax", "entropy"])
def test_peak_rss_of_n_and_8n_samples_differs_by_less_than_10_percent(tmp_path, observer):
    rng = np.random.default_rng(0)
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    for i in range(256):
        x = rng.normal(0, 1, (3, 32, 32)).astype(np.float32)
        np.save(large / f"{i:04d}.npy", x)
        if i < 32:
            np.save(small / f"{i:04d}.npy", x)
    n_small, rss_small = measure_peak_kb(small, observer)
    n_large, rss_large = measure_peak_kb(large, observer)
    assert (n_small, n_large) == (32, 256)
    # Keeping every activation (as onnxruntime's histogram calibrators do) would add ~100 MB for 224 samples.
    assert rss_large < 1.10 * rss_small, (rss_small, rss_large)
