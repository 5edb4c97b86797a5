"""Measurement helpers shared by the benchmark workers and the memory test."""

from __future__ import annotations

import resource


def peak_rss_kb() -> int:
    """This process's peak resident memory in KiB.

    VmHWM belongs to the process's own address space. ``ru_maxrss`` would also
    count the parent's memory at fork time, which Linux carries across exec.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_worker(script: str, args: list[str], timeout: int, root: str) -> dict[str, object]:
    """Run ``python -c script *args`` in its own process; its last stdout line is a JSON result.

    The process runs in a fresh temporary directory, with ``root`` (the repository) importable: tools
    that leave files in the working directory (onnxruntime's quant_pre_process writes
    ``sym_shape_infer_temp.onnx``) litter nothing. Paths in ``args`` must be absolute.
    A timeout or a failure comes back as ``{"error": ...}`` with the last line of stderr.
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        with tempfile.TemporaryDirectory(prefix="qtool-bench-") as scratch:
            proc = subprocess.run(
                [sys.executable, "-c", script, *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=scratch,
                env=env,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:240]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def onnxruntime_quantize_static(
    model: str, calib: str, out: str, *, per_channel: bool, method: str, tensorrt: bool = False
) -> str:
    """onnxruntime's ``quant_pre_process`` + ``quantize_static`` (QDQ, uint8 activations, int8 weights).

    Feeds every ``*.npy`` file of ``calib`` (sorted) to the model's single input. ``method`` names a
    ``CalibrationMethod`` (MinMax, Entropy, Percentile). ``tensorrt``: symmetric int8 activations and
    weights, onnxruntime's recipe for TensorRT. Returns a note: empty, or what was done on the way
    (qtool's own :func:`~qtool.evaluation.onnxruntime_static.quantize_with_onnxruntime`, which ``quantize
    --vs-onnxruntime`` runs too).
    """
    from pathlib import Path

    import numpy as np
    import onnx

    from qtool.evaluation.onnxruntime_static import quantize_with_onnxruntime

    name = onnx.load(model, load_external_data=False).graph.input[0].name
    feeds = ({name: np.load(f)[None]} for f in sorted(Path(calib).glob("*.npy")))
    notes = quantize_with_onnxruntime(model, feeds, out, per_channel=per_channel, method=method, symmetric=tensorrt)
    return "; ".join(notes)


def environment(date: str | None = None) -> dict[str, object]:
    """What a benchmark's numbers depend on: date, CPU (``qtool doctor``'s), cores, Python and onnxruntime."""
    import datetime
    import os
    import platform

    import onnxruntime as ort

    from qtool.system.environment import cpu_info

    return {
        "date": date or datetime.date.today().isoformat(),
        "cpu": cpu_info(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
    }
