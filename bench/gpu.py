"""GPU targets: fp32, qtool ``--target tensorrt|cuda`` and onnxruntime's quantizer on CUDA and TensorRT.

For each model (the bundled samples and the PP-OCR detector, classifier and recogniser), qtool
quantizes with ``target: tensorrt`` and with ``target: cuda`` (weights stored int8, float compute:
what onnxruntime's CUDA provider runs), and onnxruntime's ``quantize_static`` writes its QDQ model
(symmetric int8 activations and per-channel weights, what TensorRT wants), on the same calibration
samples. ``qtool compare`` then measures each against fp32 on every GPU provider this onnxruntime
build has: accuracy on that provider (worst output SQNR against the float reference), median
latency with inputs and outputs bound on the GPU, and the engine build apart; a provider the build
lists but cannot start (TensorRT without its libraries) is reported with onnxruntime's reason. Results:
bench/results/gpu.json and gpu.md. Without an NVIDIA GPU and onnxruntime-gpu it says so and
writes nothing. The script measures; it asserts nothing.

Usage: python bench/gpu.py [--models a,b] [--runs N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import onnxruntime_quantize_static  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.run import SAMPLE_MODELS, _models  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def _compare(reference: Path, candidate: Path, data: Path, providers: list[str], runs: int, cache: Path) -> dict:
    import qtool
    from qtool.options import EvaluationOptions

    options = EvaluationOptions(runs=runs, warmup=10, providers=tuple(providers), trt_engine_cache=str(cache))
    result = qtool.compare(reference, candidate, data, options=options)
    rows = {}
    for lat in result.latency:
        rows[lat.provider] = {
            "fp32_ms": lat.reference.median_ms,
            "ms": lat.candidate.median_ms,
            "p90_ms": lat.candidate.p90_ms,
            "p99_ms": lat.candidate.p99_ms,
            "speedup": lat.speedup,
            "setup_ms": list(lat.setup_ms) if lat.setup_ms else None,
            "io_binding": lat.io_binding,
            "sqnr_db": lat.candidate_sqnr_db,
        }
    return {
        "cpu_sqnr_db": min(o.sqnr_db for o in result.outputs),
        "compression": result.compression_ratio,
        "providers": rows,
        "skipped": dict(result.skipped_providers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*SAMPLE_MODELS, *REAL_MODELS]))
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    providers = [p for p in GPU_PROVIDERS if p in ort.get_available_providers()]
    if not providers:
        print(
            f"no GPU provider in this onnxruntime build ({', '.join(ort.get_available_providers())}): "
            "install the gpu extra on a machine with an NVIDIA GPU; nothing written",
            file=sys.stderr,
        )
        return
    import qtool

    rows = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-gpu-") as tmp_dir:
        tmp = Path(tmp_dir)
        for name, (model, calib, evaluation) in _models([m for m in args.models.split(",") if m]).items():
            candidates = {}
            for target in ("tensorrt", "cuda"):
                candidates[f"qtool --target {target}"] = tmp / f"{name}.qtool-{target}.onnx"
                qtool.quantize(
                    model, candidates[f"qtool --target {target}"], data_dir=calib, target=target, evaluation=None
                )
            candidates["onnxruntime quantize_static"] = tmp / f"{name}.ort.onnx"
            onnxruntime_quantize_static(
                str(model),
                str(calib),
                str(candidates["onnxruntime quantize_static"]),
                per_channel=True,
                method="MinMax",
                tensorrt=True,
            )
            for tool, path in candidates.items():
                measured = _compare(model, path, evaluation, providers, args.runs, tmp / "engines")
                rows.append({"model": name, "tool": tool, **measured})
                print(f"{name} {tool}: {measured}", file=sys.stderr)
    document = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "onnxruntime": ort.__version__,
        "providers": providers,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"Measured {document['date']}, onnxruntime {ort.__version__}; latency medians with IO binding, "
        "accuracy as worst output SQNR against the float reference, on each provider.",
        "",
        "| model | tool | compression | provider | fp32 ms | model ms | speed-up | SQNR dB there | SQNR dB on CPU "
        "| engine build ms |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for provider, m in row["providers"].items():
            build = f"{m['setup_ms'][1]:.0f}" if m["setup_ms"] else "-"
            there = f"{m['sqnr_db']:.2f}" if m["sqnr_db"] is not None else "-"
            short = provider.removesuffix("ExecutionProvider")
            lines.append(
                f"| {row['model']} | {row['tool']} | {row['compression']:.2f}x | {short} | {m['fp32_ms']:.3f} | "
                f"{m['ms']:.3f} | {m['speedup']:.2f}x | {there} | {row['cpu_sqnr_db']:.2f} | {build} |"
            )
    skipped = sorted({(provider, reason) for row in rows for provider, reason in row["skipped"].items()})
    lines += ["", *(f"Not measured on {provider}: {reason}" for provider, reason in skipped)]
    (RESULTS / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
