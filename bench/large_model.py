"""Peak memory on a large model: qtool vs onnxruntime's quantizer, per GiB of weights.

Generates (seeded) an MLP of square MatMul layers holding at least ``--gib`` GiB of
float32 weights, saved with external data, and a few input samples. Each step runs
in its own process; its peak RSS (VmHWM) is divided by the weights' size:

* ``baseline``         - a process that imports qtool and onnxruntime and does nothing;
* ``qtool calibrate``  - minmax statistics over the samples;
* ``qtool quantize``   - int8 from those statistics (no data: no search, no comparison);
* ``qtool one step``   - ``quantize --data`` (calibrate + quantize, search and comparison off);
* ``onnxruntime``      - ``quantize_static`` (QDQ, per-channel int8, minmax) with
                         ``use_external_data_format=True``, on the same model and samples.

Writes bench/results/large_model.json and large_model.md.

Usage: python bench/large_model.py [--gib 1.0] [--width 4096] [--samples 4] [--out DIR] [--skip-onnxruntime]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402

RESULTS = ROOT / "bench" / "results"

PRELUDE = r"""
import json, sys, time
from bench.measure import peak_rss_kb
def done(start, **extra):
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_kb() / 1024, **extra}))
"""

BASELINE = (
    PRELUDE
    + r"""
import onnxruntime, qtool, qtool.api
done(time.perf_counter())
"""
)

CALIBRATE = (
    PRELUDE
    + r"""
import qtool, qtool.api
model, data, stats = sys.argv[1:4]
start = time.perf_counter()
qtool.api.write_stats(qtool.calibrate(model, data, options=qtool.CalibrationOptions(observer="minmax")), stats)
done(start)
"""
)

QUANTIZE = (
    PRELUDE
    + r"""
import qtool, qtool.api
model, data, stats, out = sys.argv[1:5]
start = time.perf_counter()
if stats == "-":
    r = qtool.quantize(model, out, data_dir=data, evaluation=None, search=None)
else:
    r = qtool.quantize(model, out, stats_path=stats)
done(start, output_bytes=r.output.size_bytes, data_files=len(r.data_files))
"""
)

ONNXRUNTIME = (
    PRELUDE
    + r"""
from pathlib import Path
import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
model, data, out = sys.argv[1:4]
class Reader(CalibrationDataReader):
    def __init__(self):
        self.items = iter(sorted(Path(data).glob("*.npy")))
    def get_next(self):
        path = next(self.items, None)
        return None if path is None else {"x": np.load(path)}
start = time.perf_counter()
quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, use_external_data_format=True)
size = sum(p.stat().st_size for p in Path(out).parent.iterdir() if p.name.startswith(Path(out).name))
done(start, output_bytes=size)
"""
)


def generate(folder: Path, gib: float, width: int, samples: int) -> tuple[Path, Path, int]:
    """An MLP of ``width`` x ``width`` MatMul + Add + Relu layers with at least ``gib`` GiB of weights."""
    layer_bytes = width * width * 4
    layers = max(1, math.ceil(gib * 2**30 / layer_bytes))
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        weight = rng.standard_normal((width, width), dtype=np.float32)
        weight *= np.float32(1 / math.sqrt(width))
        inits.append(numpy_helper.from_array(weight, f"w{i}"))
        inits.append(numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}"))
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"matmul{i}"),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=f"add{i}"),
            helper.make_node("Relu", [f"add{i}"], [f"relu{i}"], name=f"relu{i}"),
        ]
        x = f"relu{i}"
    graph = helper.make_graph(
        nodes,
        "large_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    del model, graph, inits
    data = folder / "data"
    data.mkdir()
    for i in range(samples):
        np.save(data / f"{i}.npy", rng.standard_normal((1, width), dtype=np.float32))
    return path, data, layers * layer_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of float32 weights to generate (at least)")
    parser.add_argument("--width", type=int, default=4096, help="size of each square weight matrix")
    parser.add_argument("--samples", type=int, default=4, help="calibration samples")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per step")
    parser.add_argument("--skip-onnxruntime", action="store_true", help="measure qtool only")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for large_model.json and .md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qtool-large-"))
    try:
        model, data, weight_bytes = generate(work, args.gib, args.width, args.samples)
        gib = weight_bytes / 2**30
        print(f"generated {gib:.2f} GiB of weights in {work}", file=sys.stderr)
        stats = work / "stats.json"
        steps = {
            "baseline": (BASELINE, []),
            "qtool calibrate": (CALIBRATE, [str(model), str(data), str(stats)]),
            "qtool quantize": (QUANTIZE, [str(model), str(data), str(stats), str(work / "q.onnx")]),
            "qtool one step": (QUANTIZE, [str(model), str(data), "-", str(work / "q1.onnx")]),
        }
        if not args.skip_onnxruntime:
            (work / "ort").mkdir()
            steps["onnxruntime quantize_static"] = (ONNXRUNTIME, [str(model), str(data), str(work / "ort" / "q.onnx")])
        rows = {}
        for name, (script, step_args) in steps.items():
            rows[name] = run_worker(script, step_args, args.timeout, str(ROOT))
            if "peak_rss_mb" in rows[name]:
                rows[name]["rss_per_weight_gib"] = rows[name]["peak_rss_mb"] / 1024 / gib
            print(f"{name}: {rows[name]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    import onnxruntime

    document = {
        "weights_gib": gib,
        "layers": weight_bytes // (args.width * args.width * 4),
        "width": args.width,
        "samples": args.samples,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "rows": rows,
    }
    (args.out / "large_model.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"Peak RSS on a generated MLP with {gib:.2f} GiB of float32 weights ({args.width}x{args.width} MatMul layers, "
        f"external data), {args.samples} calibration samples; each step in its own process.",
        "",
        "| step | seconds | peak RSS MB | peak RSS / GiB of weights | output MB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | |")
            continue
        output = f"{row['output_bytes'] / 2**20:.0f}" if "output_bytes" in row else "-"
        lines.append(
            f"| {name} | {row['seconds']:.1f} | {row['peak_rss_mb']:.0f} | {row['rss_per_weight_gib']:.2f} | {output} |"
        )
    table = "\n".join(lines) + "\n"
    (args.out / "large_model.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
