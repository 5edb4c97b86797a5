"""Observer overhead: ``qtool.calibrate`` with each observer against the bare float pass it runs.

For every PP-OCR model (detector, classifier, recogniser on real-photo crops)
each variant runs in its own subprocess, all variants interleaved, ``--repeats``
times; the table shows medians:

* ``bare``      - what calibration does without observers: load and prepare the
                  model, plan, expose the planned tensors, read the samples and
                  run onnxruntime over them, dropping the values;
* ``unexposed`` - the same pass with only the model's own outputs (for reference);
* one row per observer - ``qtool.calibrate`` with it (2048 bins per side for the
  histogram observers).

"whole run" is each process's time from before preparing to the statistics in
hand; "float pass" is the part after preparation and planning (session, samples,
inference, observing), which is where observers cost. Overhead is the median,
over the repeats, of the variant's time over the bare pass's time in the same
repeat, minus one: runs next to each other share a machine's slow minutes. The
fastest runs' ratio ("best") is shown too. The script measures; it asserts nothing. Writes bench/results/observers.json
and observers.md.

Usage: python bench/observers.py [--samples N] [--repeats N] [--models a,b] [--observers a,b]
(--models also takes the bundled sample models: cnn, mlp, transformer.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.real_data import RegistryUnavailable, real_model  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE_MODELS = ("cnn", "mlp", "transformer")
OBSERVERS = ("minmax", "percentile", "entropy", "mse")

PRELUDE = r"""
import json, logging, sys, time
from pathlib import Path
model, calib, variant, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import qtool
import qtool.api  # the public names import lazily: load them before the clock starts
"""

QTOOL = (
    PRELUDE
    + r"""
class FloatPass(logging.Handler):  # qtool logs each stage's duration (what `qtool -v` shows)
    seconds = None
    def emit(self, record):
        if str(record.msg).startswith("%s: %.2f s") and record.args and record.args[0] == "calibrate (float pass)":
            FloatPass.seconds = record.args[1]
logger = logging.getLogger("qtool")
logger.addHandler(FloatPass())
logger.setLevel(logging.INFO)
logger.propagate = False
start = time.perf_counter()
stats = qtool.calibrate(model, calib, options=qtool.CalibrationOptions(observer=variant, limit=limit))
print(json.dumps({"seconds": time.perf_counter() - start, "float_pass": FloatPass.seconds,
                  "tensors": len(stats.tensors)}))
"""
)

BARE = (
    PRELUDE
    + r"""
import onnxruntime as ort
from qtool.pipeline.workspace import open_workspace
from qtool.calibration.dataset import Dataset, model_inputs
from qtool.calibration.statistics import with_exposed_outputs
from qtool.config import load_config
from qtool.graph.session import create_session
start = time.perf_counter()
config = load_config()
state = open_workspace(Path(model), config)
names = list(state.plan().activations)
passing = time.perf_counter()
exposed = variant == "bare"
fetch = names if exposed else [o.name for o in state.prepared.graph.output]
session = create_session(with_exposed_outputs(state.prepared, names) if exposed else state.prepared, "bare",
                         level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, weights=state.weights)
dataset = Dataset(calib, model_inputs(state.model), limit=limit, preprocess=config.preprocess)
for _, feed in dataset.batches(1):
    values = session.run(fetch, feed)
    del values
end = time.perf_counter()
print(json.dumps({"seconds": end - start, "float_pass": end - passing, "tensors": len(names)}))
"""
)


def _median(runs: list[dict[str, object]], key: str) -> float | None:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _best(runs: list[dict[str, object]], key: str) -> float | None:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return min(values) if values else None


def _overhead(value: float | None, bare: float | None) -> float | None:
    return None if value is None or not bare else value / bare - 1.0


def _paired(runs: list[dict[str, object]], bare: list[dict[str, object]], key: str) -> float | None:
    """Median over the repeats of (variant / bare of the same repeat), minus one."""
    ratios = [
        r[key] / b[key]
        for r, b in zip(runs, bare, strict=True)
        if isinstance(r.get(key), (int, float)) and isinstance(b.get(key), (int, float)) and b[key]
    ]
    return statistics.median(ratios) - 1.0 if ratios else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f} %"


def _sec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32, help="calibration samples per model")
    parser.add_argument("--repeats", type=int, default=5, help="runs of every variant (medians are reported)")
    parser.add_argument("--models", default=",".join(REAL_MODELS))
    parser.add_argument("--observers", default=",".join(OBSERVERS))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run before it is reported as timeout")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for observers.json and observers.md")
    args = parser.parse_args()
    variants = ["bare", "unexposed", *args.observers.split(",")]
    rows = []
    for name in args.models.split(","):
        if name in SAMPLE_MODELS:
            model, calib = ROOT / "sample_models" / name / "model.onnx", ROOT / "sample_models" / name / "calib"
        else:
            try:
                model, calib, _ = real_model(name, n_calib=args.samples)
            except RegistryUnavailable as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
        runs: dict[str, list[dict[str, object]]] = {v: [] for v in variants}
        for _ in range(args.repeats):  # interleaved: a noisy minute hits every variant alike
            for variant in variants:
                script = BARE if variant in ("bare", "unexposed") else QTOOL
                argv = [str(model), str(calib), variant, str(args.samples)]
                runs[variant].append(run_worker(script, argv, args.timeout, str(ROOT)))
        bare = runs["bare"]
        for variant in variants:
            mine = runs[variant]
            row = {
                "model": name,
                "variant": variant,
                "runs": mine,
                "seconds": _median(mine, "seconds"),
                "best": _best(mine, "seconds"),
                "float_pass": _median(mine, "float_pass"),
                "errors": sorted({str(r["error"]) for r in mine if "error" in r}),
            }
            if variant != "bare":
                row["overhead"] = _paired(mine, bare, "seconds")
                row["best_overhead"] = _overhead(row["best"], _best(bare, "seconds"))
                row["float_pass_overhead"] = _paired(mine, bare, "float_pass")
            rows.append(row)
            print(
                f"{name} {variant}: {_sec(row['seconds'])} s, best {_sec(row['best'])} s {row['errors'] or ''}",
                file=sys.stderr,
            )
    machine = f"{cpu_info()['model']}, {os.cpu_count()} cores"
    args.out.mkdir(parents=True, exist_ok=True)
    document = {"samples": args.samples, "repeats": args.repeats, "machine": machine, "rows": rows}
    (args.out / "observers.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"Observer overhead over {args.samples} samples per model (batch 1, CPU, {machine}), {args.repeats} runs "
        "of every variant, interleaved. Overhead: the median over the runs of the variant's time over the bare "
        "pass's in the same run, minus one; best: fastest run over fastest run.",
        "",
        "| model | variant | median s | overhead | best s | overhead (best) | float-pass overhead |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['variant']} | {_sec(row['seconds'])} | {_pct(row.get('overhead'))} | "
            f"{_sec(row['best'])} | {_pct(row.get('best_overhead'))} | {_pct(row.get('float_pass_overhead'))} |"
        )
    table = "\n".join(lines) + "\n"
    (args.out / "observers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
