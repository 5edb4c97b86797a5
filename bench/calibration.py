"""Calibration speed and memory: qtool's observers vs onnxruntime.quantization's calibrators.

For every model x method (minmax, entropy, percentile) three subprocesses run
over the same calibration samples:

* ``qtool``       - ``qtool.calibrate`` with that observer (2048 bins per side);
* ``onnxruntime`` - ``create_calibrator`` for Conv/MatMul/Gemm with the same
                    method (2048 bins, percentile 99.99), ``collect_data``,
                    ``compute_data``;
* ``bare``        - onnxruntime running qtool's prepared model with the same
                    tensors exposed, and nothing observing them: the floor
                    qtool's observer overhead is measured against.

Wall time and peak RSS are each process's own. Writes
bench/results/calibration.json and calibration.md.

Usage: python bench/calibration.py [--samples N] [--models a,b] [--methods a,b] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.real_data import RegistryUnavailable, real_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE_MODELS = ("cnn", "mlp", "transformer")
METHODS = ("minmax", "entropy", "percentile")

PRELUDE = r"""
import json, sys, time
from pathlib import Path
import numpy as np
model, calib, method, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
files = sorted(Path(calib).glob("*.npy"))[:limit]
from bench.measure import peak_rss_kb
def done(start, **extra):
    print(json.dumps({"seconds": time.perf_counter() - start,
                      "peak_rss_mb": peak_rss_kb() / 1024, **extra}))
"""

QTOOL = (
    PRELUDE
    + r"""
import qtool
import qtool.api  # the public names import lazily: load them before the clock starts, as the others do
start = time.perf_counter()
stats = qtool.calibrate(model, calib, options=qtool.CalibrationOptions(observer=method, limit=limit))
done(start, tensors=len(stats.tensors))
"""
)

BARE = (
    PRELUDE
    + r"""
from qtool.pipeline.workspace import open_workspace
from qtool.calibration.statistics import with_exposed_outputs
from qtool.config import load_config
from qtool.graph.session import create_session
import onnxruntime as ort
start = time.perf_counter()
state = open_workspace(Path(model), load_config())
names = list(state.plan().activations)
session = create_session(with_exposed_outputs(state.prepared, names), "bare",
                         level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, weights=state.weights)
feed_name = session.get_inputs()[0].name
for f in files:
    session.run(names, {feed_name: np.load(f)[None]})
done(start, tensors=len(names))
"""
)

ONNXRUNTIME = (
    PRELUDE
    + r"""
import tempfile
import onnxruntime as ort
from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator
start = time.perf_counter()
name = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).get_inputs()[0].name
class Reader(CalibrationDataReader):
    def __init__(self):
        self.it = iter(files)
    def get_next(self):
        f = next(self.it, None)
        return None if f is None else {name: np.load(f)[None]}
methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
           "percentile": CalibrationMethod.Percentile}
extra = {"entropy": {"num_bins": 2048, "num_quantized_bins": 128},
         "percentile": {"num_bins": 2048, "percentile": 99.99}}.get(method, {})
with tempfile.TemporaryDirectory() as tmp:
    calibrator = create_calibrator(model, ["Conv", "MatMul", "Gemm"], str(Path(tmp) / "augmented.onnx"),
                                   calibrate_method=methods[method], extra_options=extra)
    calibrator.collect_data(Reader())
    ranges = calibrator.compute_data()
done(start, tensors=len(ranges.data))
"""
)


def _run(script: str, model: Path, calib: Path, method: str, limit: int, timeout: int) -> dict[str, object]:
    return run_worker(script, [str(model), str(calib), method, str(limit)], timeout, str(ROOT))


def _models(selected: list[str], samples: int) -> dict[str, tuple[Path, Path]]:
    found = {}
    for name in selected:
        if name in SAMPLE_MODELS:
            found[name] = (ROOT / "sample_models" / name / "model.onnx", ROOT / "sample_models" / name / "calib")
        else:
            try:
                path, calib, _ = real_model(name, n_calib=samples)
            except RegistryUnavailable as e:
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
            found[name] = (path, calib)
    return found


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64, help="calibration samples per model")
    parser.add_argument("--models", default=",".join([*SAMPLE_MODELS, *REAL_MODELS]))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run before it is reported as timeout")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for calibration.json and calibration.md")
    args = parser.parse_args()
    rows = []
    for name, (model, calib) in _models(args.models.split(","), args.samples).items():
        bare = _run(BARE, model, calib, "minmax", args.samples, args.timeout)
        for method in args.methods.split(","):
            row = {"model": name, "method": method, "bare": bare}
            for tool, script in (("qtool", QTOOL), ("onnxruntime", ONNXRUNTIME)):
                row[tool] = _run(script, model, calib, method, args.samples, args.timeout)
            q, o = row["qtool"], row["onnxruntime"]
            if "seconds" in q and "seconds" in o:
                row["time_ratio"] = q["seconds"] / o["seconds"]
                row["rss_ratio"] = q["peak_rss_mb"] / o["peak_rss_mb"]
            if "seconds" in q and "seconds" in bare:
                row["overhead_vs_bare"] = q["seconds"] / bare["seconds"] - 1.0
            rows.append(row)
            print(f"{name} {method}: qtool {q} | onnxruntime {o}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps({"samples": args.samples, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Calibration over {args.samples} samples per model (batch 1, CPU). Ratios are qtool / onnxruntime; "
        "overhead is qtool's time over the bare float pass with the same tensors exposed.",
        "",
        "| model | method | qtool s | onnxruntime s | time ratio | qtool MB | onnxruntime MB | RSS ratio | "
        "bare pass s | qtool overhead |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        q, o, b = row["qtool"], row["onnxruntime"], row["bare"]
        lines.append(
            f"| {row['model']} | {row['method']} | {_fmt(q.get('seconds'), '.2f')} | "
            f"{_fmt(o.get('seconds'), '.2f') if 'seconds' in o else o.get('error', '-')} | "
            f"{_fmt(row.get('time_ratio'), '.2f')} | {_fmt(q.get('peak_rss_mb'), '.0f')} | "
            f"{_fmt(o.get('peak_rss_mb'), '.0f')} | {_fmt(row.get('rss_ratio'), '.2f')} | "
            f"{_fmt(b.get('seconds'), '.2f')} | "
            f"{_fmt(100 * row['overhead_vs_bare'], '.0f') + ' %' if 'overhead_vs_bare' in row else '-'} |"
        )
    table = "\n".join(lines) + "\n"
    (args.out / "calibration.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
