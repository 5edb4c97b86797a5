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
