"""Quantize one model with AMD Quark's ONNX quantizer; run with the Quark environment's python.

Usage: python bench/quark_worker.py MODEL CALIB_DIR OUT.onnx --setting NAME [--adaround-iterations N]

Quark imports torch without declaring it, and pins onnx and onnxruntime to older releases than
qtool's, so it lives in its own environment (``make quark-env``) and the benchmark calls this
script in a subprocess. Prints one JSON line: ``{"seconds", "peak_mb", "version", "settings"}``,
or ``{"error": ...}``. Quark writes files into its working directory; the script runs in a
temporary one, so paths given to it may be relative to where it was started.

Every setting quantizes the same way as onnxruntime's ``quantize_static`` in the benchmark: QDQ
format, uint8 asymmetric per-tensor activations, int8 symmetric per-channel weights, float32
scales, MinMax calibration, every operator Quark knows how to quantize (Conv, MatMul, Gemm
included). The settings differ only in the algorithms:

- ``per_channel``: none.
- ``per_channel_cle_bc``: cross-layer equalization and bias correction (Quark's defaults), its
  strongest setting on CPU without fine-tuning.
- ``per_channel_adaround``: Quark's AdaRound recipe (``A8W8_ADAROUND_QCONFIG``: learning rate 0.1,
  1000 iterations per layer, batch 1, on CPU) with the iterations capped by
  ``--adaround-iterations`` so one model finishes in minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

SETTINGS = ("per_channel", "per_channel_cle_bc", "per_channel_adaround")
DEFAULT_ADAROUND_ITERATIONS = 200  # bench/peers_integer.py passes its own per model


def _peak_mb() -> float:
    """This process's peak resident memory (VmHWM) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _config(setting: str, adaround_iterations: int, opset: int) -> tuple[Any, dict[str, Any]]:
    """Quark's ``QConfig`` for ``setting`` and a plain description of it for the result.

    Quark refuses per-channel QDQ below opset 13 (DequantizeLinear's ``axis`` came with it), which
    onnxruntime's ``quantize_static`` does not check; PP-OCR's models are opset 11 and 12, so older
    models are converted to opset 13 first (Quark's ``ConvertOpsetVersion``).
    """
    from quark.onnx import (
        AdaRoundConfig,
        BiasCorrectionConfig,
        CalibMethod,
        CLEConfig,
        Int8Spec,
        QConfig,
        QLayerConfig,
        QuantGranularity,
        ScaleType,
        UInt8Spec,
    )

    activation = UInt8Spec(
        symmetric=False,
        scale_type=ScaleType.Float32,
        calibration_method=CalibMethod.MinMax,
        quant_granularity=QuantGranularity.Tensor,
    )
    weight = Int8Spec(
        symmetric=True,
        scale_type=ScaleType.Float32,
        calibration_method=CalibMethod.MinMax,
        quant_granularity=QuantGranularity.Channel,
    )
    described: dict[str, Any] = {
        "format": "QDQ",
        "activations": "uint8 asymmetric per-tensor, MinMax",
        "weights": "int8 symmetric per-channel, MinMax",
        "scale": "float32",
    }
    algorithms: list[Any] = []
    if setting == "per_channel_cle_bc":
        algorithms = [CLEConfig(), BiasCorrectionConfig()]
        described["algorithms"] = ["CLE (defaults: balance max, 1 step)", "bias correction"]
    elif setting == "per_channel_adaround":
        # Quark's own AdaRound recipe (custom_config.adaround_algo), iterations capped.
        algorithms = [AdaRoundConfig(learning_rate=0.1, num_iterations=adaround_iterations, optim_device="cpu")]
        described["algorithms"] = [
            f"AdaRound (Quark's A8W8 recipe: lr 0.1, batch 1, {adaround_iterations} iterations per layer "
            "instead of its 1000, cpu)"
        ]
    elif setting != "per_channel":
        raise SystemExit(f"unknown setting {setting!r}; choose one of {', '.join(SETTINGS)}")
    extra: dict[str, Any] = {}
    if opset < 13:
        extra["ConvertOpsetVersion"] = 13
        described["opset"] = f"converted from {opset} to 13"
    config = QConfig(
        global_config=QLayerConfig(input_tensors=activation, weight=weight),
        algo_config=algorithms,
        extra_options={"PrintSummary": False, **extra},
    )
    return config, described


def quantize(model: Path, calib: Path, out: Path, setting: str, adaround_iterations: int) -> dict[str, Any]:
    """Quantize ``model`` with Quark, calibrating on every ``*.npy`` of ``calib``; returns the result record.

    ``seconds`` counts from before Quark is imported, as the benchmark's onnxruntime and qtool workers
    do (Quark's import loads torch and checks its custom-op library); ``quantize_seconds`` is the
    ``quantize_model`` call alone.
    """
    start = time.perf_counter()
    import numpy as np
    import onnx
    import quark
    from onnxruntime.quantization import CalibrationDataReader
    from quark.onnx import ModelQuantizer

    proto = onnx.load(str(model), load_external_data=False)
    name = proto.graph.input[0].name
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    files = sorted(calib.glob("*.npy"))
    if not files:
        raise SystemExit(f"no *.npy calibration files in {calib}")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(files)

        def get_next(self) -> dict[str, np.ndarray] | None:
            f = next(self.it, None)
            return None if f is None else {name: np.load(f)[None]}

        def rewind(self) -> None:  # bias correction and AdaRound read the data more than once
            self.it = iter(files)

    config, described = _config(setting, adaround_iterations, opset)
    begin = time.perf_counter()
    ModelQuantizer(config).quantize_model(str(model), str(out), Reader())
    end = time.perf_counter()
    if not out.exists():
        raise RuntimeError("Quark returned without writing the quantized model")
    import torch

    return {
        "seconds": end - start,
        "quantize_seconds": end - begin,
        "peak_mb": _peak_mb(),
        "version": quark.__version__,
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": _ort_version()},
        "settings": {"name": setting, "calibration_samples": len(files), **described},
    }


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def _diagnostics(log: str) -> dict[str, int]:
    """What Quark's log says its algorithms did: CLE patterns found, AdaRound layers tuned and skipped."""
    import re

    found: dict[str, int] = {}
    patterns = re.findall(r"CrossLayerEqualization pattern num: (\d+)", log)
    if patterns:
        found["cle_patterns"] = int(patterns[-1])
    if "FastFinetune" in log:
        found["adaround_layers_tuned"] = len(re.findall(r"will be optimized by adaround", log))
        found["adaround_layers_skipped"] = len(re.findall(r"Optimizing #\d+ module failed", log))
    if "BiasCorrection Done" in log:
        found["bias_correction_done"] = 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("calib", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--setting", choices=SETTINGS, default="per_channel")
    parser.add_argument(
        "--adaround-iterations",
        type=int,
        default=DEFAULT_ADAROUND_ITERATIONS,
        help="AdaRound iterations per layer (Quark's recipe uses 1000)",
    )
    args = parser.parse_args()
    model, calib, out = (p.resolve() for p in (args.model, args.calib, args.out))
    with tempfile.TemporaryDirectory(prefix="quark-bench-") as scratch:
        # Quark logs to stdout and stderr; both go to a file that is read for diagnostics and then
        # copied to stderr, so the result is the only line on stdout.
        log_path = Path(scratch) / "quark.log"
        saved = os.dup(1), os.dup(2)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        try:
            os.chdir(scratch)
            result = quantize(model, calib, out, args.setting, args.adaround_iterations)
        except BaseException as e:  # noqa: BLE001 - any failure becomes the result the bench records
            traceback.print_exc()
            message = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            result = {"error": f"{type(e).__name__}: {message}"[:300]}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(log_fd)
        log = log_path.read_text(errors="replace")
    sys.stderr.write(log)
    if "error" not in result:
        result["settings"]["quark_log"] = _diagnostics(log)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
