"""Decoder language models: qtool's int4, dynamic int8, default and fp8, next to onnxruntime's quantizers.

The sample decoder (``sample_models/decoder``, a Llama-style model trained on the standard library's
docstrings) in both its forms - plain ONNX ops (``model.onnx``) and onnxruntime's contrib ops
(``model_gqa.onnx``: GroupQueryAttention, SkipSimplifiedLayerNormalization) - is quantized by every
setting in its own process (time, peak memory), from the same calibration token files:

* qtool: its default (the measured placement choice, decode agreement included), ``mode: dynamic``,
  int4 weight-only written as MatMulNBits, asymmetric (round to nearest, GPTQ as
  ``configs/int4_matmul_nbits.yaml``, AWQ + GPTQ, and GPTQ with an int8 key/value cache, which
  onnxruntime keeps only inside GroupQueryAttention: the contrib form), and
  fp8 (e4m3 weights and activations as Q/DQ, ``configs/fp8.yaml``);
* onnxruntime: ``quantize_dynamic`` (int8) and its MatMulNBits quantizer (blocks of 32, symmetric
  and asymmetric, round to nearest).

Each result is scored against the float model with ``qtool compare`` on the held-out evaluation token
files (modules the training never saw): perplexity ratio, next-token agreement, and a greedy decode
of 16 steps per sample through the model's own cache (step agreement and free-running agreement);
the SQNR of the logits on the prefills; the size ratio; and the median latency at 1 thread of a
prefill (the sample's tokens) and of one decode step (one token after the first sample's cache), every
model timed interleaved. The script measures; it asserts nothing.

Usage: python bench/decoders.py [--forms plain,contrib] [--timeout S] [--rounds N] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import environment, run_worker  # noqa: E402
from bench.transformers import _bytes, _fmt, latencies  # noqa: E402
from qtool.calibration.dataset import Dataset, model_inputs  # noqa: E402
from qtool.calibration.decoder import complete_feed, model_decoder, next_step_feed  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SAMPLE = ROOT / "sample_models" / "decoder"
FORMS = {"plain": SAMPLE / "model.onnx", "contrib": SAMPLE / "model_gqa.onnx"}
INT4 = (  # as configs/int4_matmul_nbits.yaml: asymmetric, int8 activations in MatMulNBits, embedding table int8
    "global: {weight_only: true, weight: {dtype: int4, granularity: per_block, block_size: 32, symmetric: false, "
    "format: matmul_nbits, accuracy_level: 4}%s}\n"
    "op_type: {Gather: {weight: {dtype: int8, granularity: per_channel}}}\n"
)
QTOOL = {  # setting -> config text (None: the built-in default; a name: an installed config)
    "qtool default": None,
    "qtool dynamic int8": "global: {mode: dynamic, placement: integer}\n",
    "qtool int4 RTN": INT4 % "",
    "qtool int4 GPTQ": INT4 % ", algorithms: {rounding: gptq}",
    "qtool int4 AWQ + GPTQ": INT4 % ", algorithms: {awq: true, rounding: gptq}",
    "qtool int4 GPTQ, int8 cache": INT4 % ", algorithms: {rounding: gptq}"
    + "kv_cache: {dtype: int8, granularity: per_channel}\n",
    "qtool fp8 e4m3": "fp8",
}
PEERS = ("onnxruntime quantize_dynamic", "onnxruntime MatMulNBits RTN", "onnxruntime MatMulNBits RTN asymmetric")

WORKER = r"""
import json, sys, time
start = time.perf_counter()
tool, model, calib, out, config = sys.argv[1:6]
from bench.measure import peak_rss_kb

if tool == "qtool":
    import qtool
    result = qtool.quantize(model, out, config_path=None if config == "default" else config, data_dir=calib,
                            evaluation=None)
    note = ", ".join(f"{n} {k}" for k, n in result.placements.items())
    if result.placement_choice is not None:
        note += f"; kept '{result.placement_choice.chosen}'"
    note += "".join("; int8 cache" if "key/value cache int8" in n else "; cache float (no GQA)"
                    for n in result.notes if "key/value cache int8" in n or "cache stays float" in n)
elif tool == "onnxruntime quantize_dynamic":
    from onnxruntime.quantization import QuantType, quantize_dynamic
    quantize_dynamic(model, out, weight_type=QuantType.QInt8)
    note = "QInt8 weights, per tensor"
else:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    symmetric = "asymmetric" not in tool
    quantizer = MatMulNBitsQuantizer(onnx.load(model), block_size=32, is_symmetric=symmetric)
    quantizer.process()
    quantizer.model.save_model_to_file(out, use_external_data_format=False)
    note = f"blocks of 32, {'symmetric' if symmetric else 'asymmetric'}, default (RTN)"
print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_kb() / 1024, "note": note}))
"""


def language_metrics(model: Path, candidate: Path, evaluation: Path, limit: int | None) -> dict[str, float]:
    """qtool compare's decoder metrics and the logits' SQNR on the evaluation token files."""
    import qtool
    from qtool.options import EvaluationOptions

    result = qtool.compare(model, candidate, evaluation, options=EvaluationOptions(runs=0, limit=limit))
    lm = result.language_model
    assert lm is not None, "not recognised as a decoder"
    logits = next(m for m in result.outputs if m.name == lm.logits)
    return {
        "ppl": lm.candidate_perplexity,
        "ppl_fp32": lm.reference_perplexity,
        "ppl_ratio": lm.ppl_ratio,
        "next_token": lm.next_token_agreement,
        "decode": lm.decode_agreement or 0.0,
        "free_running": lm.free_running_agreement or 0.0,
        "free_running_bound": lm.free_running_bound,
        "logits_sqnr_db": logits.sqnr_db,
    }


def timing_feeds(model: Path, evaluation: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A prefill (the first evaluation sample) and the decode step after it, each model from its own run.

    A model with an int8 cache takes int8 pasts: its decode step holds its own cache, not fp32's.
    """
    proto = onnx.load(model, load_external_data=False)
    decoder = model_decoder(proto)
    assert decoder is not None and decoder.logits is not None
    _, sample = next(iter(Dataset(evaluation, model_inputs(onnx.load(FORMS["plain"]))).samples()))
    prefill = complete_feed(decoder, {"input_ids": sample["input_ids"]})
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, prefill), strict=True))
    step = next_step_feed(decoder, prefill, results, results[decoder.logits][:, -1].argmax(-1))
    return prefill, step


def timed(paths: dict[str, Path], evaluation: Path, rounds: int) -> dict[str, dict[str, float]]:
    """Median ms at 1 thread of each model's prefill and decode step, all models timed interleaved."""
    feeds = {key: timing_feeds(path, evaluation) for key, path in paths.items()}
    medians: dict[str, dict[str, float]] = {key: {} for key in paths}
    for position, kind in enumerate(("prefill", "decode")):
        for key, ms in latencies(paths, None, rounds, feeds={k: f[position] for k, f in feeds.items()}).items():
            medians[key][kind] = ms
    return medians


def measure(form: str, model: Path, args: argparse.Namespace, tmp: Path) -> list[dict]:
    calib, evaluation = SAMPLE / "calib", SAMPLE / "eval"
    rows: list[dict] = []
    outputs: dict[str, Path] = {"fp32": model}
    settings = [("qtool", setting, text) for setting, text in QTOOL.items()] + [(p, p, None) for p in PEERS]
    for tool, setting, text in settings:
        slug = setting.replace(" ", "_").replace("+", "").replace("__", "_")
        out = tmp / f"{form}.{slug}.onnx"
        config = "default"
        if text is not None and "\n" in text:
            config = str(tmp / f"{form}.{slug}.yaml")
            Path(config).write_text(text)
        elif text is not None:
            config = text
        result = run_worker(WORKER, [tool, str(model), str(calib), str(out), config], args.timeout, str(ROOT))
        if "error" not in result:
            result.update(language_metrics(model, out, evaluation, args.limit))
            result["ratio"] = _bytes(model) / _bytes(out)
            outputs[setting] = out
        rows.append({"model": form, "setting": setting, **result})
        print(f"{form} {setting}: {result}", file=sys.stderr)
    medians = timed(outputs, evaluation, args.rounds)
    for row in rows:
        for kind in ("prefill", "decode"):
            if row["setting"] in medians:
                row[f"{kind}_ms"] = medians[row["setting"]][kind]
                row[f"{kind}_speedup"] = medians["fp32"][kind] / medians[row["setting"]][kind]
    fp32 = {f"{kind}_ms": medians["fp32"][kind] for kind in ("prefill", "decode")}
    rows.insert(0, {"model": form, "setting": "fp32", "ratio": 1.0, **fp32})
    return rows


def render(document: dict) -> str:
    lines = [
        f"Measured {document['date']} on {document['cpu']['model']} ({document['cores']} cores, flags "
        f"{' '.join(document['cpu']['flags'])}), onnxruntime {document['onnxruntime']}. The sample decoder "
        f"(fp32 perplexity {document['ppl_fp32']:.3f} per byte on {document['eval_samples']} held-out token files of "
        "64 bytes, prompts within the 96 positions it was trained on); decode: 16 greedy steps per sample "
        "through the model's own cache, fed fp32's tokens (step) "
        "or its own (free-running); latency: median at 1 thread, every model of a form timed interleaved.",
        "",
        "| form | setting | size ratio | ppl ratio | next-token | decode step | free-running (90 % bound) "
        "| logits SQNR dB | prefill ms | decode ms | decode vs fp32 | quantize s | peak MB | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in document["rows"]:
        lines.append(
            f"| {row['model']} | {row['setting']} | {_fmt(row.get('ratio'), '.2f')}x | "
            f"{_fmt(row.get('ppl_ratio'), '.4f')} | {_fmt(row.get('next_token'), '.1%')} | "
            f"{_fmt(row.get('decode'), '.1%')} | {_fmt(row.get('free_running'), '.1%')} "
            f"({_fmt(row.get('free_running_bound'), '.1%')}) | "
            f"{_fmt(row.get('logits_sqnr_db'), '.2f')} | {_fmt(row.get('prefill_ms'), '.3f')} | "
            f"{_fmt(row.get('decode_ms'), '.3f')} | {_fmt(row.get('decode_speedup'), '.2f')}x | "
            f"{_fmt(row.get('seconds'), '.1f')} | {_fmt(row.get('peak_mb'), '.0f')} | "
            f"{row.get('note', row.get('error', ''))} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", default="plain,contrib")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--limit", type=int, default=None, help="evaluation token files scored (default: all)")
    args = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qtool-decoders-") as tmp:
        for form in args.forms.split(","):
            rows += measure(form, FORMS[form], args, Path(tmp))
    ppl = next((r["ppl_fp32"] for r in rows if "ppl_fp32" in r), float("nan"))
    document = {
        **environment(),
        "ppl_fp32": ppl,
        "eval_samples": args.limit or len(list((SAMPLE / "eval").glob("*.npz"))),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decoders.json").write_text(json.dumps(document, indent=1) + "\n")
    (RESULTS / "decoders.md").write_text(render(document))
    print(render(document))


if __name__ == "__main__":
    main()
