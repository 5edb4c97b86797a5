"""Benchmark qtool against onnxruntime's quantize_static on the bundled sample models.

For each model both tools quantize the same float model from the same
calibration set with the matching configuration (QDQ, int8 per-channel
symmetric weights, uint8 asymmetric activations, min-max calibration). Each tool
runs in its own subprocess so wall time and peak RSS are its own. Accuracy is
measured against fp32 on the disjoint evaluation set, latency interleaved in one
process. Results go to bench/results/latest.json and latest.md.

Usage: python bench/run.py [--runs N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("cnn", "mlp", "transformer")
RESULTS = ROOT / "bench" / "results"
# qtool-integer: every node as an integer kernel, like onnxruntime; qtool: the default (placement auto)
TOOLS = ("onnxruntime", "qtool-integer", "qtool")

WORKER = r"""
import json, resource, sys, time
from pathlib import Path
tool, model, calib, out = sys.argv[1:5]
start = time.perf_counter()
if tool.startswith("qtool"):
    import qtool
    config = None if tool == "qtool" else sys.argv[5]
    qtool.quantize(model, out, data_dir=calib, config_path=config, evaluate=False)
else:
    import numpy as np
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process
    name = onnx.load(model).graph.input[0].name
    files = sorted(Path(calib).glob("*.npy"))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(files)
        def get_next(self):
            f = next(self.it, None)
            return None if f is None else {name: np.load(f)[None]}

    pre = out + ".pre.onnx"
    quant_pre_process(model, pre)
    quantize_static(pre, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": elapsed, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run_tool(tool: str, model: Path, calib: Path, out: Path) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, tool, str(model), str(calib), str(out), str(ROOT / "configs" / "integer.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{tool} failed on {model}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _accuracy(ref: ort.InferenceSession, cand: ort.InferenceSession, eval_dir: Path) -> dict[str, float]:
    name = ref.get_inputs()[0].name
    signal = noise = dot = cand_sq = 0.0
    for f in sorted(eval_dir.glob("*.npy")):
        feed = {name: np.load(f)[None]}
        r = ref.run(None, feed)[0].astype(np.float64).ravel()
        c = cand.run(None, feed)[0].astype(np.float64).ravel()
        signal += r @ r
        noise += (r - c) @ (r - c)
        dot += r @ c
        cand_sq += c @ c
    return {"sqnr_db": 10 * np.log10(signal / noise), "cosine": dot / np.sqrt(signal * cand_sq)}


def _latency(paths: list[Path], feed_dir: Path, threads: int, runs: int) -> list[float]:
    sessions = [_session(p, threads) for p in paths]
    name = sessions[0].get_inputs()[0].name
    feed = {name: np.load(sorted(feed_dir.glob("*.npy"))[0])[None]}
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(10):
        for s in sessions:
            s.run(None, feed)
    for _ in range(runs):
        for s, t in zip(sessions, times, strict=True):
            start = time.perf_counter()
            s.run(None, feed)
            t.append(time.perf_counter() - start)
    return [float(np.median(t) * 1e3) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="timed runs per model for latency")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads for latency")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            model = ROOT / "sample_models" / name / "model.onnx"
            calib, evaluation = model.parent / "calib", model.parent / "eval"
            outs = {tool: Path(tmp) / f"{name}.{tool}.onnx" for tool in TOOLS}
            fp32 = _session(model, args.threads)
            row: dict[str, object] = {"model": name, "fp32_bytes": model.stat().st_size}
            for tool, out in outs.items():
                cost = _run_tool(tool, model, calib, out)
                acc = _accuracy(fp32, _session(out, args.threads), evaluation)
                row[tool] = {
                    **cost,
                    **acc,
                    "bytes": out.stat().st_size,
                    "compression": model.stat().st_size / out.stat().st_size,
                }
            medians = _latency([model, *outs.values()], evaluation, args.threads, args.runs)
            row["latency_ms"] = dict(zip(["fp32", *outs], medians, strict=True))
            rows.append(row)
            print(f"{name}: done", file=sys.stderr)
    document = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__},
        "threads": args.threads,
        "runs": args.runs,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"qtool vs onnxruntime {ort.__version__} quantize_static (QDQ, int8 per-channel weights, uint8 activations, "
        f"minmax; {args.threads} thread, median of {args.runs} interleaved runs)",
        "",
        "| model | tool | quantize s | peak RSS MB | compression | SQNR dB | cosine | latency ms (fp32 -> int8) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lat = row["latency_ms"]
        for tool in TOOLS:
            r = row[tool]
            lines.append(
                f"| {row['model']} | {tool} | {r['seconds']:.2f} | {r['peak_rss_mb']:.0f} | {r['compression']:.2f}x "
                f"| {r['sqnr_db']:.2f} | {r['cosine']:.6f} | {lat['fp32']:.3f} -> {lat[tool]:.3f} |"
            )
    table = "\n".join(lines) + "\n"
    (RESULTS / "latest.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
