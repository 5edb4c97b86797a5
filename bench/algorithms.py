"""All-integer accuracy from algorithms: qtool with each algorithm on and off, next to the best peer.

Every model (the bundled samples and the PP-OCR detector, classifier and recogniser) is quantized
with every Conv/MatMul/Gemm an integer kernel (``placement: integer``, uint8 activations, int8
per-channel weights) and each setting of ``SETTINGS``, in its own process (time and peak memory),
and scored with bench/run.py's ``accuracy`` on the evaluation crops, as bench/peers_integer.py
scores onnxruntime and AMD Quark on the same files. The table puts qtool's best setting next to the
best peer from bench/results/peers_integer.json (run that first: ``make quark-env`` then
``python bench/peers_integer.py``). The int4 rows check int4 per-channel weights against int8.
The script measures; it asserts nothing.

Usage: python bench/algorithms.py [--models a,b] [--timeout S]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.run import SAMPLE_MODELS, _models, accuracy  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"
INTEGER = "global: {placement: integer%s}\n"
SETTINGS = {  # name -> config text
    "nearest": INTEGER % "",
    "gptq": INTEGER % ", algorithms: {rounding: gptq}",
    "adaround": INTEGER % ", algorithms: {rounding: adaround}",
    "bias correction": INTEGER % ", algorithms: {bias_correction: true}",
    "equalization": INTEGER % ", algorithms: {equalization: true}",
    "smoothquant": INTEGER % ", algorithms: {smoothquant: true}",
    "gptq + bias correction": INTEGER % ", algorithms: {rounding: gptq, bias_correction: true}",
    "all": INTEGER % ", algorithms: {equalization: true, smoothquant: true, rounding: gptq, bias_correction: true}",
    "equalization + percentile": INTEGER % ", algorithms: {equalization: true}"
    + "calibration: {observer: percentile}\n",
    "all + percentile": INTEGER
    % ", algorithms: {equalization: true, smoothquant: true, rounding: gptq, bias_correction: true}"
    + "calibration: {observer: percentile}\n",
}
INT4 = {  # the sample CNN: int4 per-channel weights against int8, all-integer
    "int4 nearest": "global: {placement: integer, weight: {dtype: int4}}\n",
    "int4 gptq + bias correction": "global: {placement: integer, weight: {dtype: int4}, "
    "algorithms: {rounding: gptq, bias_correction: true}}\n",
}

WORKER = r"""
import json, sys, time
start = time.perf_counter()
model, calib, out, config = sys.argv[1:5]
import qtool
from bench.measure import peak_rss_kb
result = qtool.quantize(model, out, config_path=config, data_dir=calib, search=None, evaluation=None)
applied = sorted({name for names in result.rewrite.algorithms.values() for name in names})
print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_kb() / 1024, "applied": applied}))
"""


def measure(models: dict[str, tuple[Path, Path, Path]], timeout: int, tmp: Path) -> list[dict]:
    rows = []
    for name, (model, calib, evaluation) in models.items():
        settings = {**SETTINGS, **(INT4 if name == "cnn" else {})}
        for setting, text in settings.items():
            config, out = tmp / f"{name}.{len(rows)}.yaml", tmp / f"{name}.{len(rows)}.onnx"
            config.write_text(text)
            result = run_worker(WORKER, [str(model), str(calib), str(out), str(config)], timeout, str(ROOT))
            if "error" not in result:
                result.update(accuracy(model, out, evaluation))
            rows.append({"model": name, "setting": setting, **result})
            print(f"{name} {setting}: {result}", file=sys.stderr)
    return rows


def summary(document: dict, peers: dict[str, object], simulated: dict[str, object] | None = None) -> list[str]:
    """Per model: qtool with nearest rounding, qtool's best int8 setting, and the best peer (and its simulated best)."""
    simulated = simulated or {}
    lines = [
        "| model | qtool nearest dB | qtool best (setting) | its quantize s | best peer (setting) | peer quantize s "
        "| qtool best - peer dB | best peer simulated dB |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for model in dict.fromkeys(row["model"] for row in document["rows"]):
        rows = [r for r in document["rows"] if r["model"] == model and isinstance(r.get("sqnr_db"), float)]
        int8 = [r for r in rows if not r["setting"].startswith("int4")]
        if not int8:
            continue
        nearest = next((r["sqnr_db"] for r in int8 if r["setting"] == "nearest"), None)
        best = max(int8, key=lambda r: r["sqnr_db"])
        peer = peers.get(model)
        peer_sqnr = getattr(peer, "sqnr_db", None)
        peer_text = f"{peer_sqnr:.2f} ({peer.tool} {peer.setting})" if peer is not None else "-"  # type: ignore[attr-defined]
        margin = best["sqnr_db"] - peer_sqnr if isinstance(peer_sqnr, float) else None
        lines.append(
            f"| {model} | {_fmt(nearest, '.2f')} | {best['sqnr_db']:.2f} ({best['setting']}) | "
            f"{_fmt(best.get('seconds'), '.1f')} | {peer_text} | {_fmt(getattr(peer, 'seconds', None), '.1f')} | "
            f"{_fmt(margin, '+.2f')} | {_peer_text(simulated.get(model))} |"
        )
    return lines


def _peer_text(peer: object) -> str:
    sqnr = getattr(peer, "sqnr_db", None)
    return f"{sqnr:.2f} ({peer.tool} {peer.setting})" if isinstance(sqnr, float) else "-"  # type: ignore[attr-defined]


def render(document: dict, peers: dict[str, object]) -> str:
    lines = [
        f"Measured {document['date']} on {document['cpu']['model']} ({document['cores']} cores, flags "
        f"{' '.join(document['cpu']['flags'])}), onnxruntime {document['onnxruntime']}; "
        "every Conv/MatMul/Gemm an integer kernel (uint8 activations, int8 per-channel weights unless "
        "int4 is named), SQNR of all outputs on the evaluation crops.",
        "",
        "| model | qtool setting | quantize s | peak MB | SQNR dB | best peer | peer SQNR dB | qtool - peer dB |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for row in document["rows"]:
        peer = peers.get(row["model"])
        peer_text = f"{peer.tool} {peer.setting}" if peer is not None else "-"  # type: ignore[attr-defined]
        peer_sqnr = peer.sqnr_db if peer is not None else None  # type: ignore[attr-defined]
        sqnr = row.get("sqnr_db")
        margin = sqnr - peer_sqnr if isinstance(sqnr, float) and isinstance(peer_sqnr, float) else None
        lines.append(
            f"| {row['model']} | {row['setting']} | {_fmt(row.get('seconds'), '.1f')} | "
            f"{_fmt(row.get('peak_mb'), '.0f')} | {_fmt(sqnr, '.2f')} | {peer_text} | {_fmt(peer_sqnr, '.2f')} | "
            f"{_fmt(margin, '+.2f')} |" + (f" {row['error']}" if "error" in row else "")
        )
    lines += ["", *summary(document, peers, _peers("simulated_sqnr_db"))]
    return "\n".join(lines) + "\n"


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _peers(metric: str = "sqnr_db") -> dict[str, object]:
    """The best peer per model from bench/results/peers_integer.json, by ``metric``."""
    try:
        from bench.peers_integer import best_peer_sqnr

        return dict(best_peer_sqnr(metric=metric))
    except (ImportError, OSError, KeyError, ValueError) as e:
        print(f"no peer results ({e}); run bench/peers_integer.py first", file=sys.stderr)
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*SAMPLE_MODELS, *REAL_MODELS]))
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--render", action="store_true", help="only re-render the saved results with the peers'")
    args = parser.parse_args()
    if args.render:
        text = render(json.loads((RESULTS / "algorithms.json").read_text()), _peers())
        (RESULTS / "algorithms.md").write_text(text)
        print(text)
        return
    with tempfile.TemporaryDirectory(prefix="qtool-algorithms-") as tmp:
        rows = measure(_models(args.models.split(",")), args.timeout, Path(tmp))
    saved = RESULTS / "algorithms.json"
    if saved.exists():  # the other models' rows stay as last measured
        measured = {row["model"] for row in rows}
        rows = [r for r in json.loads(saved.read_text())["rows"] if r["model"] not in measured] + rows
    document = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_info(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "algorithms.json").write_text(json.dumps(document, indent=1) + "\n")
    text = render(document, _peers())
    (RESULTS / "algorithms.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
