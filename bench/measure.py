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


PER_CHANNEL_OPSET = 13  # DequantizeLinear takes an axis (per-channel scales) from opset 13


def onnxruntime_quantize_static(
    model: str, calib: str, out: str, *, per_channel: bool, method: str, tensorrt: bool = False
) -> str:
    """onnxruntime's ``quant_pre_process`` + ``quantize_static`` (QDQ, uint8 activations, int8 weights).

    Feeds every ``*.npy`` file of ``calib`` (sorted) to the model's single input. ``method`` names a
    ``CalibrationMethod`` (MinMax, Entropy, Percentile). ``tensorrt``: symmetric int8 activations and
    weights, onnxruntime's recipe for TensorRT. Returns a note: empty, or why pre-processing was skipped.
    """
    from pathlib import Path

    import numpy as np
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    name = onnx.load(model).graph.input[0].name
    files = sorted(Path(calib).glob("*.npy"))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(files)

        def get_next(self) -> dict[str, np.ndarray] | None:
            f = next(self.it, None)
            return None if f is None else {name: np.load(f)[None]}

    import os
    import tempfile

    source, note = os.path.abspath(out + ".pre.onnx"), ""
    model = os.path.abspath(model)
    # quant_pre_process writes sym_shape_infer_temp.onnx into the working directory: run it in a scratch one
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="ort-pre-") as scratch:
        os.chdir(scratch)
        try:
            quant_pre_process(model, source)
        except Exception as e:  # noqa: BLE001 - onnxruntime's symbolic shape inference fails on many models
            source, note = model, f"quant_pre_process failed ({type(e).__name__}); quantized without it"
        finally:
            os.chdir(here)
        opset = next(
            (
                o.version
                for o in onnx.load(source, load_external_data=False).opset_import
                if o.domain in ("", "ai.onnx")
            ),
            0,
        )
        if per_channel and opset < PER_CHANNEL_OPSET:
            # onnxruntime writes per-channel DequantizeLinear (its axis attribute) into an opset-11 model as it is,
            # and no runtime loads that: the model is converted first, as onnxruntime's documentation advises
            from onnx import version_converter

            converted = os.path.join(scratch, "opset13.onnx")
            onnx.save(version_converter.convert_version(onnx.load(source), PER_CHANNEL_OPSET), converted)
            source, note = converted, f"{note}; " if note else ""
            note += f"converted from opset {opset} to {PER_CHANNEL_OPSET} (per-channel DequantizeLinear)"
        quantize_static(
            source,
            out,
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            activation_type=QuantType.QInt8 if tensorrt else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=getattr(CalibrationMethod, method),
            # TensorRT's explicit quantization: symmetric int8 on both sides (onnxruntime's recipe for it)
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True} if tensorrt else None,
        )
    return note


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
