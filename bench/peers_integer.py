"""The numbers qtool's all-integer quantization must beat: onnxruntime's and AMD Quark's best SQNR per model.

For every model (the bundled samples and the PP-OCR detector, classifier and recogniser; see
bench/run.py) the peers quantize the same file on the same calibration crops, each in its own
process, and the result is scored on the same evaluation crops with bench/run.py's ``accuracy``
(SQNR of all outputs together against fp32):

- onnxruntime ``quantize_static`` (QDQ after ``quant_pre_process``, uint8 activations, int8
  per-channel weights) with MinMax, Entropy and Percentile calibration;
- AMD Quark's ONNX quantizer, run by bench/quark_worker.py in Quark's own environment
  (``make quark-env``; the interpreter is ``$QTOOL_QUARK_PYTHON``, default
  ``.venv-quark/bin/python`` in the repository, else ``/work/.venv-quark/bin/python``), with
  the same data types plus nothing, CLE and bias correction, or AdaRound (iterations capped,
  see ``ADAROUND_ITERATIONS``). Without that interpreter the Quark rows say so and the rest runs.

Every node the peers quantize is integer (QDQ around every Conv, MatMul and Gemm), the setting
qtool's ``placement: integer`` is compared with. The script measures; it asserts nothing.
Results: bench/results/peers_integer.json and peers_integer.md. ``best_peer_sqnr`` gives the
best peer per model from those results, for the rows qtool has to beat.

Usage: python bench/peers_integer.py [--models a,b] [--tools onnxruntime,quark] [--timeout S]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402
from bench.real_data import MODELS as REAL_MODELS  # noqa: E402
from bench.run import SAMPLE_MODELS, _models, accuracy, open_session  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RESULT_NAME = "peers_integer"
QUARK_WORKER = ROOT / "bench" / "quark_worker.py"
ONNXRUNTIME_SETTINGS = {  # setting -> onnxruntime CalibrationMethod
    "per-channel minmax": "MinMax",
    "per-channel entropy": "Entropy",
    "per-channel percentile": "Percentile",
}
QUARK_SETTINGS = ("per_channel", "per_channel_cle_bc", "per_channel_adaround")
# AdaRound iterations per layer. Quark's recipe runs 1000; on two cores its per-layer data
# extraction (a quantized and a float inference of the whole model over the 64 calibration
# samples, once per layer) plus the training made the PP-OCR models take far past 15 minutes,
# so the real models get fewer. The small samples finish the full recipe in seconds.
ADAROUND_ITERATIONS = {"cnn": 1000, "mlp": 1000, "transformer": 1000}
ADAROUND_ITERATIONS_DEFAULT = 40  # the detector: ~440 s of data extraction, then ~7 s per iteration

ONNXRUNTIME_WORKER = r"""
import json, sys, time
start = time.perf_counter()
model, calib, out, method = sys.argv[1:5]
from bench.measure import onnxruntime_quantize_static, peak_rss_kb
note = onnxruntime_quantize_static(model, calib, out, per_channel=True, method=method)
import onnxruntime
print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_kb() / 1024, "note": note,
                  "version": onnxruntime.__version__}))
"""


@dataclass(frozen=True)
class Peer:
    """The best peer result on one model: the SQNR qtool's all-integer model has to beat."""

    model: str
    tool: str
    setting: str
    sqnr_db: float
    seconds: float | None = None  # its quantize time


def quark_python() -> Path | None:
    """Quark's interpreter: ``$QTOOL_QUARK_PYTHON``, the repository's ``.venv-quark`` or ``/work/.venv-quark``."""
    configured = os.environ.get("QTOOL_QUARK_PYTHON")
    candidates = (
        [Path(configured)] if configured else [ROOT / ".venv-quark/bin/python", Path("/work/.venv-quark/bin/python")]
    )
    return next((c for c in candidates if c.exists()), None)


def _quark(python: Path, setting: str, name: str, model: Path, calib: Path, out: Path, timeout: int) -> dict:
    iterations = ADAROUND_ITERATIONS.get(name, ADAROUND_ITERATIONS_DEFAULT)
    command = [str(python), str(QUARK_WORKER), str(model), str(calib), str(out), "--setting", setting]
    command += ["--adaround-iterations", str(iterations)]
    try:
        with tempfile.TemporaryDirectory(prefix="quark-bench-") as scratch:
            # TMPDIR inside the scratch folder: a worker killed at the timeout leaves nothing behind.
            env = {**os.environ, "TMPDIR": scratch}
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False, cwd=scratch, env=env
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if not lines:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": (tail[-1] if tail else f"exit {proc.returncode}")[:240]}
    return json.loads(lines[-1])


def simulated_sqnr(model: Path, candidate: Path, eval_dir: Path) -> float:
    """SQNR of ``candidate`` run without graph optimizations: Q/DQ in float, no integer kernels.

    On CPUs without VNNI onnxruntime's uint8 x int8 kernels can saturate their 16-bit
    intermediate sums, so the SQNR of the integer model (bench/run.py's ``accuracy``) also depends
    on the machine; this one measures only the quantization choices.
    """
    return accuracy(model, candidate, eval_dir, simulated=True)["sqnr_db"]


def _drop_extra_outputs(model: Path, candidate: Path) -> str:
    """Remove graph outputs the float model does not have; returns a note naming how many, or ``""``.

    Quark 0.13's bias correction saves the model with the intermediate tensors it measured still
    listed as graph outputs; the outputs the float model has are left as they are.
    """
    wanted = {o.name for o in onnx.load(str(model), load_external_data=False).graph.output}
    quantized = onnx.load(str(candidate))
    extra = [o for o in quantized.graph.output if o.name not in wanted]
    if not extra:
        return ""
    for output in extra:
        quantized.graph.output.remove(output)
    onnx.save(quantized, str(candidate))
    return f"{len(extra)} extra graph outputs left by the tool removed before scoring"


def _clear_value_info(candidate: Path) -> None:
    """Drop the model's stored intermediate shapes, so onnxruntime infers them again."""
    quantized = onnx.load(str(candidate))
    del quantized.graph.value_info[:]
    onnx.save(quantized, str(candidate))


def _score(model: Path, out: Path, evaluation: Path, result: dict) -> dict:
    """Load ``out`` in onnxruntime and score it; a model that fails is a result too.

    Quark 0.13 stores wrong intermediate shapes (``value_info``) for models with dynamic input
    sizes, such as PP-OCR's: onnxruntime refuses the model or fails while running it. Such a
    model is recorded as failing and then scored with its ``value_info`` cleared, which is what a
    user of it would have to do.
    """
    if "error" in result:
        return {**result, "loads": None}
    notes = [result.get("note") or "", _drop_extra_outputs(model, out)]
    try:
        open_session(out, 1)
        result = {**result, "loads": True, "runs_as_written": True}
    except Exception as e:  # noqa: BLE001 - a model onnxruntime refuses is a result too
        refusal = f"onnxruntime cannot load it: {str(e).splitlines()[0][:200]}"
        _clear_value_info(out)
        try:
            open_session(out, 1)
        except Exception:  # noqa: BLE001
            return {**result, "loads": False, "error": refusal}
        result = {**result, "loads": False, "runs_as_written": False, "run_error": refusal}
        notes.append("onnxruntime refuses it as written (wrong value_info shapes); scored with value_info cleared")
    try:
        scores = accuracy(model, out, evaluation)
    except Exception as e:  # noqa: BLE001 - a model onnxruntime cannot run is a result too
        reason = str(e).rsplit("FAIL :", 1)[-1].strip().splitlines()[0][:160]  # onnxruntime's innermost message
        result.update(runs_as_written=False, run_error=reason)
        notes.append("onnxruntime fails to run it as written (wrong value_info shapes); scored with value_info cleared")
        _clear_value_info(out)
        try:
            scores = accuracy(model, out, evaluation)
        except Exception as again:  # noqa: BLE001
            return {**result, "error": f"onnxruntime cannot run it: {str(again).splitlines()[0][:200]}"}
    note = "; ".join(n for n in notes if n)
    return {**result, "note": note, **scores, "simulated_sqnr_db": simulated_sqnr(model, out, evaluation)}


def measure(
    models: dict[str, tuple[Path, Path, Path]],
    tools: list[str],
    timeout: int,
    tmp: Path,
    quark_settings: tuple[str, ...] = QUARK_SETTINGS,
) -> Iterator[dict]:
    """Quantize and score every model with every peer setting; yields one row per model."""
    python = quark_python() if "quark" in tools else None
    if "quark" in tools and python is None:
        print(
            "Quark rows skipped: no Quark interpreter (run `make quark-env` or set QTOOL_QUARK_PYTHON)", file=sys.stderr
        )
    for name, (model, calib, evaluation) in models.items():
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        runs: dict[str, dict] = {}
        if "onnxruntime" in tools:
            for setting, method in ONNXRUNTIME_SETTINGS.items():
                out = tmp / f"{name}.ort.{method}.onnx"
                result = run_worker(ONNXRUNTIME_WORKER, [str(model), str(calib), str(out), method], timeout, str(ROOT))
                runs[f"onnxruntime | {setting}"] = _score(model, out, evaluation, result)
                print(f"{name} onnxruntime {setting}: {runs[f'onnxruntime | {setting}']}", file=sys.stderr)
        if "quark" in tools:
            for setting in quark_settings:
                key = f"quark | {setting}"
                if python is None:
                    runs[key] = {"error": "skipped: no Quark interpreter (make quark-env)", "loads": None}
                    continue
                out = tmp / f"{name}.quark.{setting}.onnx"
                runs[key] = _score(model, out, evaluation, _quark(python, setting, name, model, calib, out, timeout))
                print(f"{name} {key}: {runs[key]}", file=sys.stderr)
        yield {
            "model": name,
            "wall_seconds": time.perf_counter() - started,
            # Another process on the machine slows every tool's timing alike; the SQNRs do not move.
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "runs": runs,
        }


def best_peer_sqnr(document: dict | None = None, metric: str = "sqnr_db") -> dict[str, Peer]:
    """The best peer SQNR per model, from ``document`` or bench/results/peers_integer.json.

    ``metric`` is ``sqnr_db`` (the integer model as onnxruntime runs it on this machine) or
    ``simulated_sqnr_db`` (Q/DQ in float).
    """
    if document is None:
        document = json.loads((RESULTS / f"{RESULT_NAME}.json").read_text())
    best: dict[str, Peer] = {}
    for row in document["rows"]:
        for key, result in row["runs"].items():
            sqnr = result.get(metric)
            if not isinstance(sqnr, (int, float)):
                continue
            tool, setting = key.split(" | ")
            if row["model"] not in best or sqnr > best[row["model"]].sqnr_db:
                best[row["model"]] = Peer(row["model"], tool, setting, float(sqnr), result.get("seconds"))
    return best


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def render(document: dict) -> str:
    """The Markdown report: a header with versions and machine, one row per run, then the best peer per model."""
    machine, versions = document["machine"], document["versions"]
    quark = versions.get("quark") or {}
    quark_text = (
        f"AMD Quark {quark['amd-quark']} (torch {quark.get('torch')}, onnx {quark.get('onnx')}, onnxruntime "
        f"{quark.get('onnxruntime')}, its own environment)"
        if quark
        else "AMD Quark not run"
    )
    lines = [
        f"Measured {document['measured']} on {machine['model']} ({machine['cores']} cores, flags "
        f"{' '.join(machine['flags']) or 'none'}), onnxruntime "
        f"{versions['onnxruntime']}, onnx {versions['onnx']}, numpy {versions['numpy']}; {quark_text}.",
        "All peers: QDQ, uint8 asymmetric per-tensor activations, int8 symmetric per-channel weights, every "
        "Conv/MatMul/Gemm quantized; 64 calibration and 32 evaluation samples per model; SQNR of all outputs "
        "against fp32 (bench/run.py's accuracy). Quark AdaRound: its A8W8 recipe (lr 0.1, batch 1) with "
        f"iterations per layer capped at {document['adaround_iterations']}. SQNR (simulated): the same model "
        "run without graph optimizations, so Q/DQ run in float and no integer kernel can saturate.",
        "",
        "| model | tool | setting | quantize s | peak MB | SQNR dB | cosine | SQNR dB (simulated) "
        "| loads in onnxruntime |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in document["rows"]:
        for key, r in row["runs"].items():
            tool, setting = key.split(" | ")
            loads = {True: "yes", False: "no", None: "-"}[r.get("loads")]
            if r.get("runs_as_written") is False:
                loads = "loads, fails to run" if r.get("loads") else "no"
            if "error" in r:
                lines.append(f"| {row['model']} | {tool} | {setting} | failed: {r['error']} | | | | | {loads} |")
                continue
            if r.get("note"):
                setting += f" ({r['note']})"
            lines.append(
                f"| {row['model']} | {tool} | {setting} | {_fmt(r['seconds'], '.1f')} | "
                f"{_fmt(r.get('peak_mb'), '.0f')} | {_fmt(r['sqnr_db'], '.2f')} | {_fmt(r['cosine'], '.5f')} | "
                f"{_fmt(r.get('simulated_sqnr_db'), '.2f')} | {loads} |"
            )
    lines += [
        "",
        "| model | best peer | its SQNR dB | qtool must reach (+1 dB) | best simulated SQNR dB (peer) "
        "| peers' wall time s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    best, simulated = best_peer_sqnr(document), best_peer_sqnr(document, "simulated_sqnr_db")
    for row in document["rows"]:
        peer, sim = best.get(row["model"]), simulated.get(row["model"])
        sim_text = f"{sim.sqnr_db:.2f} ({sim.tool} {sim.setting})" if sim else "-"
        if peer is None:
            lines.append(f"| {row['model']} | none succeeded | - | - | {sim_text} | {row['wall_seconds']:.0f} |")
            continue
        lines.append(
            f"| {row['model']} | {peer.tool} {peer.setting} | {peer.sqnr_db:.2f} | {peer.sqnr_db + 1:.2f} | "
            f"{sim_text} | {row['wall_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _document(rows: list[dict]) -> dict:
    quark = next((r for row in rows for k, r in row["runs"].items() if k.startswith("quark") and "version" in r), {})
    return {
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {**cpu_info(), "cores": os.cpu_count(), "python": platform.python_version()},
        "versions": {
            "onnxruntime": ort.__version__,
            "onnx": onnx.__version__,
            "numpy": np.__version__,
            "quark": {"amd-quark": quark["version"], **quark.get("versions", {})} if quark else {},
        },
        "adaround_iterations": {**ADAROUND_ITERATIONS, "others": ADAROUND_ITERATIONS_DEFAULT},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*SAMPLE_MODELS, *REAL_MODELS]))
    parser.add_argument("--tools", default="onnxruntime,quark", help="comma-separated: onnxruntime, quark")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per quantization before it counts as failed")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for {RESULT_NAME}.json and .md")
    parser.add_argument("--quark-settings", default=",".join(QUARK_SETTINGS), help="comma-separated Quark settings")
    parser.add_argument(
        "--update",
        action="store_true",
        help="replace only the runs measured now in the existing results (each run keeps its own 'measured' stamp)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{RESULT_NAME}.json"
    rows: list[dict] = json.loads(path.read_text())["rows"] if args.update and path.exists() else []
    quark_settings = tuple(args.quark_settings.split(","))
    models, table = _models(args.models.split(",")), ""
    with tempfile.TemporaryDirectory() as folder:
        for row in measure(models, args.tools.split(","), args.timeout, Path(folder), quark_settings):
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            for run in row["runs"].values():
                run["measured"] = stamp
            old = next((r for r in rows if r["model"] == row["model"]), None)
            if old is None:
                rows.append(row)
            else:  # --update: the other runs, their wall time and load stay as they were measured
                old["runs"].update(row["runs"])
            # Written after every model: a long run that stops part-way keeps what it measured.
            document = _document(rows)
            (args.out / f"{RESULT_NAME}.json").write_text(json.dumps(document, indent=2) + "\n")
            table = render(document)
            (args.out / f"{RESULT_NAME}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
