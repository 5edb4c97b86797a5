"""``qtool tune --target-sqnr 30`` on the sample models and the real PP-OCR models: its promise, and whether it holds.

Each model is tuned once through the command line (the whole command's wall time and peak memory).
tune splits EVAL in two: it selects on one half and validates its choice on the other, and its
promise is the validated figure's lower confidence bound. A third set of files that tune never
touched then scores the written model through ``qtool compare``: the sample models' EVAL is split
here into 16 files for tune and 16 untouched ones, the real models get 16 more crops of the same
photos. The promise holds when the third set's figure is within 1 dB of it (or above).
``qtool quantize --config CHOSEN.yaml`` is run to check that the config reproduces the model byte
for byte. The Pareto front of what was tried (size, selection SQNR) is listed per model. Writes
bench/results/tune.{json,md}.

Usage: python bench/tune.py [--target DB] [--time-budget S] [--models cnn,mlp,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402

from bench.real_data import RegistryUnavailable, real_model  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLES = ("cnn", "mlp", "transformer", "encoder")
REAL = ("ppocr_det", "ppocr_cls", "ppocr_rec")
QTOOL = [sys.executable, "-m", "qtool"]


def data_for(name: str, tmp: Path) -> tuple[Path, Path, Path, Path]:
    """(model, CALIB, EVAL for tune, a third set tune never touches): 16 files each."""
    if name in SAMPLES:
        folder = ROOT / "sample_models" / name
        model, calib, files = folder / "model.onnx", folder / "calib", sorted((folder / "eval").iterdir())
    else:
        model, calib, crops = real_model(name, n_calib=32, n_eval=32)  # the first 16 are the 16-crop set's own
        files = sorted(crops.glob("*.npy"))
    evaluation, unseen = tmp / f"{name}-eval", tmp / f"{name}-unseen"
    for folder, part in ((evaluation, files[:16]), (unseen, files[16:32])):
        folder.mkdir()
        for path in part:
            (folder / path.name).symlink_to(path)
    return model, calib, evaluation, unseen


def compare_json(model: Path, candidate: Path, data: Path, check: Path) -> dict:
    """`qtool compare --json` of ``candidate`` against ``model`` on ``data`` (kept at ``check``)."""
    command = [*QTOOL, "-q", "compare", str(model), str(candidate), "--data", str(data), "--runs", "0"]
    subprocess.run([*command, "--json", str(check)], check=True, capture_output=True)
    return json.loads(check.read_text())


PEAK = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(done.returncode)\n"
)


def timed(command: list[str]) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall seconds and peak resident KiB of one command (measured by a wrapper that runs only it)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *command], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = done.stderr.strip().splitlines()
    peak = int(lines[-1]) if lines and lines[-1].isdigit() else 0
    return seconds, peak, done


def tune_one(name: str, target: float, budget: float, tmp: Path) -> dict:
    model, calib, evaluation, unseen = data_for(name, tmp)
    out, chosen, report = tmp / f"{name}.onnx", tmp / f"{name}.yaml", tmp / f"{name}.json"
    command = [*QTOOL, "-q", "tune", str(model), "--data", str(calib), "--eval", str(evaluation)]
    command += ["--target-sqnr", str(target), "--time-budget", str(budget), "-o", str(out)]
    command += ["--config-out", str(chosen), "--json", str(report), "--no-cache"]  # first-run times, every time
    seconds, peak, done = timed(command)
    if done.returncode not in (0, 1):
        return {"model": name, "error": done.stderr.strip().splitlines()[-2:-1]}  # the last line is the peak
    doc = json.loads(report.read_text())
    compared = compare_json(model, out, evaluation, tmp / f"{name}.check.json")
    fresh = compare_json(model, out, unseen, tmp / f"{name}.unseen.json")
    again = tmp / f"{name}.again.onnx"
    subprocess.run(
        [*QTOOL, "-q", "quantize", str(model), "--config", str(chosen), "--data", str(calib), "-o", str(again)],
        check=True,
        capture_output=True,
    )
    front = sorted((t for t in doc["trials"] if t["pareto"]), key=lambda t: -t["compression_ratio"])
    chosen_trial = next(t for t in doc["trials"] if t["chosen"])
    return {
        "model": name,
        "met": doc["met"],
        "seconds": seconds,
        "peak_mib": peak / 1024,
        "nodes": doc["sensitivity"]["nodes"],
        "sensitivity_seconds": doc["sensitivity"]["seconds"],
        "trials": len(doc["trials"]),
        "compression": compared["size"]["compression_ratio"],
        "sqnr_db": compared["accuracy"]["overall"]["sqnr_db"],
        "selection_sqnr_db": doc["written"]["sqnr_db"],
        "promise_db": doc["promise_db"] if doc["met"] else doc["validation"]["bound_db"],
        "validated_bound_db": doc["validation"]["bound_db"],
        "validated_sqnr_db": doc["validation"]["sqnr_db"],
        "unseen_sqnr_db": fresh["accuracy"]["overall"]["sqnr_db"],
        "holds": fresh["accuracy"]["overall"]["sqnr_db"]
        >= (doc["promise_db"] if doc["met"] else doc["validation"]["bound_db"]) - 1.0,
        "validations": len(doc["rounds"]),
        "rounds": [
            {
                "margin_db": r["margin"],
                "compression": doc["trials"][r["trial"]]["compression_ratio"],
                "validated_db": r["validation"]["sqnr_db"],
                "bound_db": r["validation"]["bound_db"],
                "meets": r["validation"]["meets"],
            }
            for r in doc["rounds"]
        ],
        "margin_db": doc["margin"],
        "precisions": chosen_trial["precisions"],
        "reproduced": again.read_bytes() == out.read_bytes(),
        "pareto": [
            {"compression": t["compression_ratio"], "sqnr_db": t["sqnr_db"], "precisions": t["precisions"]}
            for t in front
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=30.0)
    parser.add_argument("--time-budget", type=float, default=600.0)
    parser.add_argument("--models", default=",".join((*SAMPLES, *REAL)))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-tune-") as scratch:
        for name in args.models.split(","):
            try:
                row = tune_one(name, args.target, args.time_budget, Path(scratch))
            except RegistryUnavailable as e:
                row = {"model": name, "error": f"skipped: {e}"}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "pareto"}), flush=True)
    document = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_info(), "python": platform.python_version(), "onnxruntime": ort.__version__},
        "target_sqnr_db": args.target,
        "time_budget_s": args.time_budget,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tune.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        f"# qtool tune --target-sqnr {args.target:g} ({document['date']}, {cpu_info()['model']} "
        f"{platform.machine()}, onnxruntime {ort.__version__})",
        "",
        "| model | nodes | met | compression | promise dB | validated dB (bound) | third set dB | holds (1 dB) "
        "| selection dB | precisions | wall s | sensitivity s | candidates | validations | peak MiB | reproduced |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | {r['error']} |" + " |" * 13)
            continue
        precisions = ", ".join(f"{k} {v}" for k, v in r["precisions"].items())
        lines.append(
            f"| {r['model']} | {r['nodes']} | {'yes' if r['met'] else 'no'} | {r['compression']:.2f}x | "
            f"{r['promise_db']:.2f} | {r['validated_sqnr_db']:.2f} ({r['validated_bound_db']:.2f}) | "
            f"{r['unseen_sqnr_db']:.2f} | "
            f"{'yes' if r['holds'] else 'NO'} | {r['selection_sqnr_db']:.2f} | {precisions} | {r['seconds']:.0f} | "
            f"{r['sensitivity_seconds']:.0f} | {r['trials']} | {r['validations']} | {r['peak_mib']:.0f} | "
            f"{'yes' if r['reproduced'] else 'NO'} |"
        )
    lines += ["", "Pareto fronts (compression, SQNR dB on the selection samples):", ""]
    for r in rows:
        if "pareto" in r:
            front = "; ".join(f"{p['compression']:.2f}x {p['sqnr_db']:.1f} dB" for p in r["pareto"])
            lines.append(f"- {r['model']}: {front}")
    (RESULTS / "tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
