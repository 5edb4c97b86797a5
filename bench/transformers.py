"""Transformers: qtool's dynamic, static, int4 weight-only (RTN, GPTQ, AWQ) and default, next to onnxruntime's.

Every setting quantizes the same model with the same calibration samples, in its own process (time
and peak memory): qtool's ``mode: dynamic``, all-integer static int8, int4 weight-only written as
MatMulNBits (round to nearest, GPTQ, AWQ) and its default (the measured placement choice), and
onnxruntime's ``quantize_dynamic``, ``quantize_static`` (QDQ, per channel) and its MatMulNBits
quantizer (blocks of 32, symmetric, its default round to nearest). Each result is scored on the
evaluation samples against the float model: the SQNR of the sentence output (``pooled`` where the
model has one, else its float outputs of rank 2, else every output), the file size ratio (weights in
external data included), and
the median latency at 1 thread, the float model and every result timed interleaved on one sample.
The script measures; it asserts nothing.

Usage: python bench/transformers.py [--models encoder,text_encoder] [--timeout S] [--rounds N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import environment, run_worker  # noqa: E402
from bench.real_data import RegistryUnavailable, real_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLES = ("encoder", "transformer")
INT4 = (  # asymmetric, embedding tables int8 per row, as configs/int4_matmul_nbits.yaml has them
    "global: {weight_only: true, weight: {dtype: int4, granularity: per_block, block_size: 32, symmetric: false, "
    "format: matmul_nbits}%s}\nop_type: {Gather: {weight: {dtype: int8, granularity: per_channel}}}\n"
)
QTOOL = {  # setting -> config text (None: the built-in default)
    "qtool default": None,
    "qtool dynamic int8": "global: {mode: dynamic, placement: integer}\n",
    "qtool static int8": "global: {placement: integer}\n",
    "qtool int4 RTN": INT4 % "",
    "qtool int4 GPTQ": INT4 % ", algorithms: {rounding: gptq}",
    "qtool int4 AWQ": INT4 % ", algorithms: {awq: true}",
    "qtool int4 AWQ + GPTQ": INT4 % ", algorithms: {awq: true, rounding: gptq}",
}
PEERS = ("onnxruntime quantize_dynamic", "onnxruntime quantize_static", "onnxruntime MatMulNBits RTN")
SENTENCE_OUTPUTS = ("pooled", "sentence_embedding", "pooler_output", "sentence_embeddings")

WORKER = r"""
import json, sys, time
start = time.perf_counter()
tool, model, calib, out, config = sys.argv[1:6]
from pathlib import Path
import numpy as np
from bench.measure import peak_rss_kb
from bench.transformers import feeds

if tool == "qtool":
    import qtool
    result = qtool.quantize(model, out, config_path=None if config == "default" else config, data_dir=calib,
                            evaluation=None)
    note = ", ".join(f"{n} {k}" for k, n in result.placements.items())
elif tool == "onnxruntime quantize_dynamic":
    from onnxruntime.quantization import QuantType, quantize_dynamic
    quantize_dynamic(model, out, weight_type=QuantType.QInt8)
    note = "QInt8 weights, per tensor"
elif tool == "onnxruntime quantize_static":
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    samples = feeds(Path(model), Path(calib))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(samples)

        def get_next(self):
            return next(self.it, None)

    quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    note = "QDQ, per channel, MinMax"
else:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    quantizer = MatMulNBitsQuantizer(onnx.load(model), block_size=32, is_symmetric=True)
    quantizer.process()
    quantizer.model.save_model_to_file(out, use_external_data_format=False)
    note = "blocks of 32, symmetric, default (RTN)"
print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_kb() / 1024, "note": note}))
"""


def feeds(model: Path, directory: Path) -> list[dict[str, np.ndarray]]:
    """The samples of ``directory`` as feeds, read the way qtool reads a dataset (a batch axis added)."""
    import onnx

    from qtool.calibration.dataset import Dataset, model_inputs

    inputs = model_inputs(onnx.load(str(model), load_external_data=False))
    return [feed for _, feed in Dataset(directory, inputs).samples()]


def _session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _one_row_per_sample(session: ort.InferenceSession) -> list[str]:
    """Float outputs of rank 2 (a sentence embedding exported under a numeric name, say)."""
    return [o.name for o in session.get_outputs() if o.type == "tensor(float)" and len(o.shape) == 2]


def accuracy(model: Path, candidate: Path, samples: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """SQNR (dB) and cosine of the sentence output, or of all outputs, against the float model."""
    ref, cand = _session(model, 2), _session(candidate, 2)
    names = [o.name for o in ref.get_outputs()]
    chosen = [n for n in names if n in SENTENCE_OUTPUTS] or _one_row_per_sample(ref) or names
    signal = noise = dot = cand_sq = 0.0
    for feed in samples:
        r = np.concatenate([o.astype(np.float64).ravel() for o in ref.run(chosen, feed)])
        c = np.concatenate([o.astype(np.float64).ravel() for o in cand.run(chosen, feed)])
        signal, noise = signal + r @ r, noise + (r - c) @ (r - c)
        dot, cand_sq = dot + r @ c, cand_sq + c @ c
    return {
        "output": ",".join(chosen),
        "sqnr_db": float(10 * np.log10(signal / noise)) if noise else float("inf"),
        "cosine": float(dot / np.sqrt(signal * cand_sq)) if signal and cand_sq else 0.0,
    }


def _bytes(path: Path) -> int:
    """The model file and the external data files beside it that it names."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    extra = {
        entry.value for tensor in model.graph.initializer for entry in tensor.external_data if entry.key == "location"
    }
    return path.stat().st_size + sum((path.parent / name).stat().st_size for name in extra)


def latencies(
    paths: dict[str, Path],
    feed: dict[str, np.ndarray] | None,
    rounds: int,
    *,
    feeds: dict[str, dict[str, np.ndarray]] | None = None,
) -> dict[str, float]:
    """Median ms per model at 1 thread, all timed interleaved: ``rounds`` rounds of 10 runs each.

    ``feed`` feeds every model, or ``feeds`` gives each model (by the keys of ``paths``) its own.
    """
    sessions = {key: _session(path, 1) for key, path in paths.items()}
    feeds = feeds or {key: feed or {} for key in paths}
    for key, session in sessions.items():
        for _ in range(5):
            session.run(None, feeds[key])
    times: dict[str, list[float]] = {key: [] for key in sessions}
    for _ in range(rounds):
        for key, session in sessions.items():
            start = time.perf_counter()
            for _ in range(10):
                session.run(None, feeds[key])
            times[key].append((time.perf_counter() - start) / 10)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def _models(selected: list[str]) -> dict[str, tuple[Path, Path, Path]]:
    found = {}
    for name in selected:
        if name in SAMPLES:
            base = ROOT / "sample_models" / name
            if (base / "model.onnx").exists():
                found[name] = (base / "model.onnx", base / "calib", base / "eval")
            continue
        try:
            found[name] = real_model(name)
        except (RegistryUnavailable, KeyError) as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
    return found


def measure(name: str, paths: tuple[Path, Path, Path], timeout: int, rounds: int, tmp: Path) -> list[dict]:
    model, calib, evaluation = paths
    samples = feeds(model, evaluation)
    rows: list[dict] = []
    outputs: dict[str, Path] = {"fp32": model}
    settings = [("qtool", setting, text) for setting, text in QTOOL.items()] + [(p, p, None) for p in PEERS]
    for tool, setting, text in settings:
        slug = setting.replace(" ", "_").replace("+", "").replace("__", "_")
        out = tmp / f"{name}.{slug}.onnx"
        config = "default"
        if text is not None:
            config = str(tmp / f"{name}.{slug}.yaml")
            Path(config).write_text(text)
        result = run_worker(WORKER, [tool, str(model), str(calib), str(out), config], timeout, str(ROOT))
        if "error" not in result:
            result.update(accuracy(model, out, samples))
            result["ratio"] = _bytes(model) / _bytes(out)
            outputs[setting] = out
        rows.append({"model": name, "setting": setting, **result})
        print(f"{name} {setting}: {result}", file=sys.stderr)
    medians = latencies(outputs, samples[0], rounds)
    for row in rows:
        if row["setting"] in medians:
            row["latency_ms"] = medians[row["setting"]]
            row["speedup"] = medians["fp32"] / medians[row["setting"]]
    rows.insert(0, {"model": name, "setting": "fp32", "latency_ms": medians["fp32"], "ratio": 1.0})
    return rows


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def render(document: dict) -> str:
    lines = [
        f"Measured {document['date']} on {document['cpu']['model']} ({document['cores']} cores, flags "
        f"{' '.join(document['cpu']['flags'])}), onnxruntime {document['onnxruntime']}; SQNR of the sentence "
        "output (`pooled` where the model has one) on the evaluation samples, size ratio against the fp32 "
        "file, median latency at 1 thread (every model of one table timed interleaved on one sample).",
        "",
        "| model | setting | SQNR dB | cosine | size ratio | latency ms | vs fp32 | quantize s | peak MB | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in document["rows"]:
        lines.append(
            f"| {row['model']} | {row['setting']} | {_fmt(row.get('sqnr_db'), '.2f')} | "
            f"{_fmt(row.get('cosine'), '.5f')} | {_fmt(row.get('ratio'), '.2f')}x | "
            f"{_fmt(row.get('latency_ms'), '.3f')} | {_fmt(row.get('speedup'), '.2f')}x | "
            f"{_fmt(row.get('seconds'), '.1f')} | {_fmt(row.get('peak_mb'), '.0f')} | "
            f"{row.get('note', row.get('error', ''))} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="encoder,text_encoder")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    models = _models([m for m in args.models.split(",") if m])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qtool-bench-transformers-") as tmp:
        for name, paths in models.items():
            rows += measure(name, paths, args.timeout, args.rounds, Path(tmp))
    document = {
        **environment(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transformers.json").write_text(json.dumps(document, indent=2) + "\n")
    (RESULTS / "transformers.md").write_text(render(document))
    print(render(document))


if __name__ == "__main__":
    main()
