"""What qtool's default costs next to onnxruntime's quantize_static, on the same models and files.

For every model — the bundled samples, the PP-OCR detector, classifier and recogniser (64
calibration crops of real photos), and two generated large-activation models (a Conv-STFT audio
front end on 10 s of raw audio, a detector on 800x608 images; see bench/generated.py) — each tool
quantizes in its own subprocess, ``--repeats`` times, alternating tools:

- qtool: ``qtool quantize MODEL --data CALIB -o OUT.onnx --json R.json``, exactly what a user runs
  (calibration, the measured placement choice, and the comparison on the calibration data);
- onnxruntime: ``quant_pre_process`` then ``quantize_static`` (QDQ, MinMax, per-channel int8
  weights, uint8 activations) with a data reader over the same files;
- qtool ``--config integer``: every node an integer kernel with the ops between them chained, the model
  that competes with onnxruntime's on speed (its accuracy and speed-ups are reported; its cost is not bounded).

Reported per model: the median wall time and peak RSS of each tool and their ratios (the bounds:
3x the time, 1.5x the memory), then both models' SQNR on the evaluation files (the worst output,
each output pooled over the files, as qtool's target reads; and all outputs together), their speed-up
over fp32 at 1 thread and at every core (median of interleaved runs in one process), and the
placement qtool kept.
The script measures; it asserts nothing. Results: bench/results/cost.json and cost.md.

Usage: python bench/cost.py [--models a,b] [--repeats N] [--runs N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.generated import GENERATORS, generated_model  # noqa: E402
from bench.measure import run_worker  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.real_data import RegistryUnavailable, real_model  # noqa: E402
from bench.run import accuracy, latency_medians, open_session  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE_MODELS = ("cnn", "mlp", "transformer")
TIME_BOUND, MEMORY_BOUND = 3.0, 1.5

WORKER = r"""
import json, sys, time
tool, model, calib, out = sys.argv[1:5]
start = time.perf_counter()
if tool.startswith("qtool"):
    from qtool.cli import main
    config = ["--config", "integer"] if tool == "qtool-integer" else []
    try:
        main(["quantize", model, "--data", calib, "-o", out, "--json", out + ".json", *config])
    except SystemExit as e:
        if e.code:
            raise
else:
    from bench.measure import onnxruntime_quantize_static
    onnxruntime_quantize_static(model, calib, out, per_channel=True, method="MinMax")
from bench.measure import peak_rss_kb
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_kb() / 1024}))
"""


def _speedups(model: Path, candidates: dict[str, Path], eval_dir: Path, runs: int, threads: int) -> dict[str, float]:
    """fp32 median / candidate median at ``threads`` intra-op threads, interleaved."""
    medians = latency_medians({"fp32": model, **candidates}, eval_dir, threads, runs)
    return {key: medians["fp32"] / medians[key] for key in candidates}


def _unloadable(path: Path) -> str | None:
    """Why onnxruntime refuses a model a tool wrote (a peer's quantizer can write one it cannot load), or None."""
    try:
        open_session(path, 1)
    except Exception as e:  # noqa: BLE001 - any refusal is the row's result, not the benchmark's end
        return f"onnxruntime cannot load the model it wrote: {str(e).strip().splitlines()[0][:300]}"
    return None


def _worst_output_sqnr(model: Path, candidate: Path, eval_dir: Path) -> float:
    """The worst output's SQNR over the evaluation files (each output pooled over them), as qtool scores it."""
    reference, quantized = open_session(model, 2), open_session(candidate, 2)
    name = reference.get_inputs()[0].name
    signal: list[float] = []
    noise: list[float] = []
    for path in sorted(eval_dir.glob("*.npy")):
        feed = {name: np.load(path)[None]}
        for index, (r, c) in enumerate(zip(reference.run(None, feed), quantized.run(None, feed), strict=True)):
            r64, c64 = np.asarray(r, np.float64).ravel(), np.asarray(c, np.float64).ravel()
            if index == len(signal):
                signal.append(0.0)
                noise.append(0.0)
            signal[index] += float(r64 @ r64)
            noise[index] += float((r64 - c64) @ (r64 - c64))
    return min(10 * np.log10(s / n) if n else float("inf") for s, n in zip(signal, noise, strict=True))


def _models(selected: list[str]) -> dict[str, tuple[Path, Path, Path]]:
    found = {}
    for name in selected:
        if name in SAMPLE_MODELS:
            base = ROOT / "sample_models" / name
            found[name] = (base / "model.onnx", base / "calib", base / "eval")
        elif name in GENERATORS:
            found[name] = generated_model(name)
        else:
            try:
                found[name] = real_model(name)
            except RegistryUnavailable as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
    return found


def _median(results: list[dict[str, object]], key: str) -> float | None:
    values = [float(r[key]) for r in results if key in r]  # type: ignore[arg-type]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*SAMPLE_MODELS, *REAL_MODELS, *GENERATORS]))
    parser.add_argument("--repeats", type=int, default=3, help="quantizations per tool and model (medians)")
    parser.add_argument("--runs", type=int, default=30, help="timed inference runs per model for the speed-up")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per quantization before it counts as failed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for cost.json and cost.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for name, (model, calib, evaluation) in _models(args.models.split(",")).items():
            results: dict[str, list[dict[str, object]]] = {"qtool": [], "onnxruntime": [], "qtool-integer": []}
            outputs = {tool: tmp / f"{name}.{tool}.onnx" for tool in results}
            for _ in range(args.repeats):
                for tool in results:
                    worker_args = [tool, str(model), str(calib), str(outputs[tool])]
                    result = run_worker(WORKER, worker_args, args.timeout, str(ROOT))
                    print(f"{name} {tool}: {result}", file=sys.stderr)
                    results[tool].append(result)
            row: dict[str, object] = {"model": name, "calibration_samples": len(list(calib.glob("*.npy")))}
            for tool, runs in results.items():
                errors = [str(r["error"]) for r in runs if "error" in r]
                row[tool] = {
                    "seconds": _median(runs, "seconds"),
                    "peak_rss_mb": _median(runs, "peak_rss_mb"),
                    "error": errors[0] if errors else None,
                }
            done = {}
            for tool, path in outputs.items():
                refused = _unloadable(path) if path.exists() else "no model written"
                if refused is None:
                    done[tool] = path
                elif row[tool]["error"] is None:  # type: ignore[index]
                    row[tool]["error"] = refused  # type: ignore[index]
            for tool, path in done.items():
                row[tool]["sqnr_db"] = accuracy(model, path, evaluation)["sqnr_db"]  # type: ignore[index]
                row[tool]["worst_output_db"] = _worst_output_sqnr(model, path, evaluation)  # type: ignore[index]
            for tool, speedup in _speedups(model, done, evaluation, args.runs, 1).items():
                row[tool]["speedup_1t"] = speedup  # type: ignore[index]
            for tool, speedup in _speedups(model, done, evaluation, args.runs, os.cpu_count() or 1).items():
                row[tool]["speedup_all"] = speedup  # type: ignore[index]
            report = outputs["qtool"].with_name(outputs["qtool"].name + ".json")
            if report.exists():
                choice = json.loads(report.read_text()).get("placement_choice") or {}
                row["qtool"]["placement"] = choice.get("chosen")  # type: ignore[index]
            rows.append(row)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = cpu_info()
    document = {
        "measured": stamp,
        "machine": {**machine, "cores": os.cpu_count(), "python": platform.python_version()},
        "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__},
        "repeats": args.repeats,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"Measured {stamp} on {machine['model']} ({os.cpu_count()} cores, flags {' '.join(machine['flags'])}), "
        f"onnxruntime {ort.__version__}; medians of {args.repeats} quantizations per tool; speed-up: fp32 median / "
        f"model median at 1 thread and at all {os.cpu_count()} threads, {args.runs} interleaved runs; SQNR on the "
        f"evaluation files: the worst output (each pooled over the files), and all outputs together. "
        f"Bounds: time <= {TIME_BOUND:g}x, peak RSS <= {MEMORY_BOUND:g}x onnxruntime's.",
        "",
        "| model | ORT s | qtool s | time ratio | ORT MB | qtool MB | memory ratio | ORT worst dB | qtool worst dB | "
        "ORT all dB | qtool all dB | ORT speed-up 1t / all | qtool speed-up 1t / all | qtool placement | "
        "integer worst dB | integer speed-up 1t / all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        q, o, i = row["qtool"], row["onnxruntime"], row["qtool-integer"]
        assert isinstance(q, dict) and isinstance(o, dict) and isinstance(i, dict)
        time_ratio = q["seconds"] / o["seconds"] if q["seconds"] and o["seconds"] else None
        memory_ratio = q["peak_rss_mb"] / o["peak_rss_mb"] if q["peak_rss_mb"] and o["peak_rss_mb"] else None

        def cell(value: object, spec: str, bound: float | None = None) -> str:
            if not isinstance(value, (int, float)):
                return "-"
            text = format(value, spec)
            return f"**{text}** (over)" if bound is not None and value > bound else text

        cells = [
            cell(o["seconds"], ".1f"),
            cell(q["seconds"], ".1f"),
            cell(time_ratio, ".2f", TIME_BOUND),
            cell(o["peak_rss_mb"], ".0f"),
            cell(q["peak_rss_mb"], ".0f"),
            cell(memory_ratio, ".2f", MEMORY_BOUND),
            cell(o.get("worst_output_db"), ".2f"),
            cell(q.get("worst_output_db"), ".2f"),
            cell(o.get("sqnr_db"), ".2f"),
            cell(q.get("sqnr_db"), ".2f"),
            cell(o.get("speedup_1t"), ".2f") + "x / " + cell(o.get("speedup_all"), ".2f") + "x",
            cell(q.get("speedup_1t"), ".2f") + "x / " + cell(q.get("speedup_all"), ".2f") + "x",
            str(q.get("placement") or "-"),
            cell(i.get("worst_output_db"), ".2f"),
            cell(i.get("speedup_1t"), ".2f") + "x / " + cell(i.get("speedup_all"), ".2f") + "x",
        ]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
        for tool in ("onnxruntime", "qtool", "qtool-integer"):
            if row[tool]["error"]:  # type: ignore[index]
                lines.append(f"| {row['model']} | {tool} failed: {row[tool]['error']} |||||||||||||||")  # type: ignore[index]
    table = "\n".join(lines) + "\n"
    (args.out / "cost.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
