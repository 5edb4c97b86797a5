"""Peak memory of int4 on a generated Llama-style decoder with over 2 GiB of external weights.

Generates (seeded) :mod:`sample_models.decoder`'s plain-op decoder at Llama-7B widths (hidden 4096,
32 heads, 8 key/value heads, ffn 11008, vocabulary 32000) with enough layers for ``--gib`` GiB of
float32 weights, written straight to an external data file one tensor at a time (no protobuf ever
holds the weights), and a few token files. Each step runs in its own process; its peak RSS (VmHWM)
is divided by the weights' bytes (the target of issue 36: at most 1.5):

* ``baseline``                - imports qtool and onnxruntime and does nothing;
* ``qtool int4 nearest``      - weight-only int4 MatMulNBits, blocks of 32, round to nearest, no data;
* ``qtool int4_matmul_nbits`` - ``configs/int4_matmul_nbits.yaml`` (GPTQ) on the token files;
* ``onnxruntime MatMulNBits`` - onnxruntime's ``MatMulNBitsQuantizer`` (int4, blocks of 32, symmetric).

No search and no comparison: they are the same as on any model and would add the float model's
run. Writes bench/results/large_decoder.json and large_decoder.md.

Usage: python bench/large_decoder.py [--gib 2.1] [--tokens 16] [--files 4] [--out DIR] [--skip-onnxruntime]
       [--skip-calibrated]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.large_model import BASELINE, PRELUDE  # noqa: E402
from bench.measure import run_worker  # noqa: E402
from sample_models.decoder import DecoderShape, external_plain_model, token_files, weight_shapes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LLAMA = DecoderShape(vocab=32000, hidden=4096, layers=1, heads=32, kv_heads=8, ffn=11008, max_positions=256)
NEAREST = """version: 1
global:
  weight: {dtype: int4, granularity: per_block, block_size: 32, symmetric: true,
           format: matmul_nbits, accuracy_level: 4}
  weight_only: true
  algorithms: {rounding: nearest}
op_type:
  Gather: {weight: {dtype: int8, granularity: per_channel}}
"""

QUANTIZE = (
    PRELUDE
    + r"""
import qtool
model, config, data, out = sys.argv[1:5]
start = time.perf_counter()
r = qtool.quantize(model, out, config_path=config, data_dir=None if data == "-" else data, evaluation=None, search=None)
rounded = {}  # how many weighted nodes each weight algorithm reached (GPTQ falls back to nearest past its budget)
for names in r.rewrite.algorithms.values():
    for name in names:
        rounded[name] = rounded.get(name, 0) + 1
reasons = {}  # why an algorithm the config asked for did not run, by reason (node names dropped)
for why in r.rewrite.algorithm_notes.values():
    reason = why.split(": ", 1)[1] if why.startswith("node ") else why
    reasons[reason] = reasons.get(reason, 0) + 1
done(start, output_bytes=r.output.size_bytes, algorithms=rounded, not_applied=reasons)
"""
)

ONNXRUNTIME = (
    PRELUDE
    + r"""
from pathlib import Path
import onnx
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
model, out = sys.argv[1:3]
start = time.perf_counter()
quantizer = MatMulNBitsQuantizer(onnx.load(model), block_size=32, is_symmetric=True, accuracy_level=4)
quantizer.process()
quantizer.model.save_model_to_file(out, use_external_data_format=True)
size = sum(p.stat().st_size for p in Path(out).parent.iterdir())
done(start, output_bytes=size)
"""
)


def layers_for(gib: float, shape: DecoderShape) -> int:
    """The fewest layers that give at least ``gib`` GiB of float32 weights."""
    one = weight_shapes(DecoderShape(**{**shape.__dict__, "layers": 1}))
    two = weight_shapes(DecoderShape(**{**shape.__dict__, "layers": 2}))
    fixed = 2 * sum(math.prod(d) for d in one.values()) - sum(math.prod(d) for d in two.values())
    per_layer = sum(math.prod(d) for d in two.values()) - sum(math.prod(d) for d in one.values())
    return max(1, math.ceil((gib * 2**30 / 4 - fixed) / per_layer))


def _algorithms(row: dict) -> str:
    """Which weight algorithms ran on how many nodes, and why they did not on the others."""
    ran = [f"{name} on {count} nodes" for name, count in row.get("algorithms", {}).items()]
    missed = [f"not on {count}: {reason}" for reason, count in row.get("not_applied", {}).items()]
    return "; ".join(ran + missed) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.1, help="GiB of float32 weights to generate (at least)")
    parser.add_argument("--files", type=int, default=4, help="token files (calibration samples)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per file")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per step")
    parser.add_argument("--skip-onnxruntime", action="store_true", help="measure qtool only")
    parser.add_argument(
        "--skip-calibrated", action="store_true", help="skip int4_matmul_nbits (GPTQ on the token files: long)"
    )
    parser.add_argument("--work", type=Path, default=None, help="folder for the generated model (default: a temp one)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for large_decoder.json and .md")
    args = parser.parse_args()
    shape = DecoderShape(**{**LLAMA.__dict__, "layers": layers_for(args.gib, LLAMA)})
    work = Path(tempfile.mkdtemp(prefix="qtool-decoder-", dir=args.work))
    try:
        model, weight_bytes = external_plain_model(work, shape)
        data = work / "tokens"
        rng = np.random.default_rng(1)
        token_files(data, rng.integers(0, shape.vocab, size=(args.files, args.tokens)))
        config = work / "int4_nearest.yaml"
        config.write_text(NEAREST)
        gib = weight_bytes / 2**30
        print(f"generated {shape.layers} layers, {gib:.2f} GiB of weights in {work}", file=sys.stderr)
        steps = {
            "baseline": (BASELINE, []),
            "qtool int4 nearest (no data)": (QUANTIZE, [str(model), str(config), "-", str(work / "q_nearest.onnx")]),
        }
        if not args.skip_calibrated:
            int4 = str(ROOT / "qtool" / "configs" / "int4_matmul_nbits.yaml")
            calibrated = [str(model), int4, str(data), str(work / "q.onnx")]
            steps["qtool int4_matmul_nbits (GPTQ)"] = (QUANTIZE, calibrated)
        if not args.skip_onnxruntime:
            (work / "ort").mkdir()
            steps["onnxruntime MatMulNBitsQuantizer"] = (ONNXRUNTIME, [str(model), str(work / "ort" / "q.onnx")])
        rows = {}
        for name, (script, step_args) in steps.items():
            rows[name] = run_worker(script, step_args, args.timeout, str(ROOT))
            if "peak_rss_mb" in rows[name]:
                rows[name]["rss_per_weight_bytes"] = rows[name]["peak_rss_mb"] * 2**20 / weight_bytes
            print(f"{name}: {rows[name]}", file=sys.stderr)
            for old in work.glob("q*.onnx*"):
                old.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(args, shape, weight_bytes, rows)


def write_results(args: argparse.Namespace, shape: DecoderShape, weight_bytes: int, rows: dict) -> None:
    """bench/results/large_decoder.json and .md."""
    import onnxruntime

    args.out.mkdir(parents=True, exist_ok=True)
    document = {
        "weight_bytes": weight_bytes,
        "shape": shape.__dict__,
        "files": args.files,
        "tokens": args.tokens,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "rows": rows,
    }
    (args.out / "large_decoder.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"Peak RSS quantizing a generated Llama-style decoder to int4: {shape.layers} layers, hidden {shape.hidden}, "
        f"ffn {shape.ffn}, vocabulary {shape.vocab}, {weight_bytes / 2**30:.2f} GiB ({weight_bytes:,} bytes) of "
        f"float32 weights in external data; {args.files} token files of {args.tokens} tokens. Each step in its own "
        "process; target: peak RSS at most 1.5 x the weight bytes.",
        "",
        "| step | seconds | peak RSS MB | peak RSS / weight bytes | meets 1.5x | output MB | algorithms |",
        "|---|---:|---:|---:|:---:|---:|---|",
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | | | |")
            continue
        output = f"{row['output_bytes'] / 2**20:.0f}" if "output_bytes" in row else "-"
        ratio = row["rss_per_weight_bytes"]
        lines.append(
            f"| {name} | {row['seconds']:.1f} | {row['peak_rss_mb']:.0f} | {ratio:.2f} | "
            f"{'yes' if ratio <= 1.5 else 'no'} | {output} | "
            f"{_algorithms(row)} |"
        )
    table = "\n".join(lines) + "\n"
    (args.out / "large_decoder.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
