"""Calibration spread over Dask workers against one process, on a real detector at 800x608.

PP-OCRv4's text detector (from the rapidocr-onnxruntime wheel, dynamic height and width) is
calibrated with the entropy observer over seeded 608x800 crops of real photos, four ways, each
round interleaved:

* ``one process``       - ``qtool calibrate`` as it is (onnxruntime and the observers on every core);
* ``--workers N``       - a local Dask cluster of N worker processes, one thread each, started by the
                          command itself (its start-up is in the time);
* ``--scheduler ADDR``  - N workers already running, started with Dask's own CLI (``dask scheduler``,
                          ``dask worker --nthreads 1``), as a cluster would be;
* ``N --shard processes`` - no engine at all: N ``qtool calibrate --shard k/N --threads 1`` started at
                          once, then ``qtool merge``: the ceiling any engine could reach on this machine.

Each row is the whole command's wall time; the statistics files of every round are compared byte for
byte with the one-process file. Writes bench/results/scaleout.{json,md}.

Usage: python bench/scaleout.py [--samples N] [--workers N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import environment  # noqa: E402
from bench.real_data import RegistryUnavailable, real_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BIN = Path(sys.executable).parent
SIZE = (608, 800)


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {seconds} s")
        time.sleep(0.2)


def start_cluster(workers: int, tmp: Path) -> tuple[str, list[subprocess.Popen]]:
    """A scheduler and ``workers`` single-threaded workers on localhost, through Dask's CLI."""
    address_file = tmp / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    scheduler = [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard"]
    started = [subprocess.Popen([*scheduler, "--scheduler-file", str(address_file)], **quiet)]  # type: ignore[call-overload]
    _wait_for(address_file, 60)
    worker = [str(BIN / "dask"), "worker", "--scheduler-file", str(address_file), "--nthreads", "1"]
    for _ in range(workers):
        started.append(subprocess.Popen([*worker, "--no-dashboard", "--host", "127.0.0.1"], **quiet))  # type: ignore[call-overload]
    address = json.loads(address_file.read_text())["address"]
    from distributed import Client

    with Client(address, set_as_default=False) as client:
        client.wait_for_workers(workers, timeout=60)
    return address, started


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return seconds


def timed_shards(base: list[str], out: Path, shards: int) -> float:
    """Wall time of ``shards`` concurrent one-thread shard processes and the merge of their files."""
    parts = [out.with_suffix(f".{k}.json") for k in range(1, shards + 1)]
    start = time.perf_counter()
    running = [
        subprocess.Popen(
            [*base, str(part), "--shard", f"{k}/{shards}", "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, part in enumerate(parts, start=1)
    ]
    for process in running:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a shard failed: {stderr.strip()}")
    merge = [str(BIN / "qtool"), "merge", *map(str, parts), "-o", str(out)]
    result = subprocess.run(merge, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"merge failed: {result.stderr.strip()}")
    return time.perf_counter() - start


PER_CROP = """
import sys, time, numpy as np, onnxruntime as ort
options = ort.SessionOptions()
options.intra_op_num_threads = int(sys.argv[3])
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
feed = {session.get_inputs()[0].name: np.load(sys.argv[2])[None]}
session.run(None, feed)
start = time.perf_counter()
for _ in range(16):
    session.run(None, feed)
print((time.perf_counter() - start) / 16)
"""


def seconds_per_crop(model: Path, crop: Path, threads: int, processes: int) -> list[float]:
    """onnxruntime alone: seconds per crop of ``processes`` sessions of ``threads`` threads run at once."""
    command = [sys.executable, "-c", PER_CROP, str(model), str(crop), str(threads)]
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [float(p.communicate()[0]) for p in running]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        model, calib, _ = real_model("ppocr_det", n_calib=args.samples, n_eval=1, size=SIZE)
    except RegistryUnavailable as e:
        print(f"skipping: {e}", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        address, cluster = start_cluster(args.workers, tmp)
        try:
            base = [str(BIN / "qtool"), "calibrate", str(model), str(calib), "--observer", "entropy", "-o"]
            settings = {
                "one process": [],
                f"--workers {args.workers}": ["--workers", str(args.workers)],
                f"--scheduler ({args.workers} workers)": ["--scheduler", address],
                f"{args.workers} --shard processes, no engine": None,
            }
            times: dict[str, list[float]] = {key: [] for key in settings}
            identical = dict.fromkeys(settings, True)
            for r in range(args.rounds):
                for key, extra in settings.items():
                    out = tmp / f"{r}-{key.split()[0].strip('-')}.json"  # 0-one.json, 0-workers.json, ...
                    if extra is None:
                        times[key].append(timed_shards(base, out, args.workers))
                    else:
                        times[key].append(timed([*base, str(out), *extra]))
                    reference = tmp / f"{r}-one.json"  # one process runs first in every round
                    identical[key] &= out.read_bytes() == reference.read_bytes()
                    print(f"round {r + 1} {key}: {times[key][-1]:.2f} s", file=sys.stderr)
        finally:
            for process in reversed(cluster):
                process.terminate()
            for process in cluster:
                process.wait(30)
    crop = sorted(calib.glob("*.npy"))[0]
    ceiling = {
        "one session, 2 threads": seconds_per_crop(model, crop, 2, 1),
        "two sessions at once, 1 thread each": seconds_per_crop(model, crop, 1, 2),
    }
    one = statistics.median(times["one process"])
    rows = [
        {
            "setting": key,
            "median_s": statistics.median(values),
            "times_s": values,
            "ratio": statistics.median(values) / one,
            "identical": identical[key],
        }
        for key, values in times.items()
    ]
    document = {
        **environment(),
        "model": "ppocr_det (PP-OCRv4 text detector)",
        "input": f"1x3x{SIZE[0]}x{SIZE[1]}",
        "samples": args.samples,
        "observer": "entropy",
        "rows": rows,
        "onnxruntime_seconds_per_crop": ceiling,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scaleout.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        f"Measured {document['date']} on {document['cpu']['model']} ({document['cores']} cores), onnxruntime "
        f"{document['onnxruntime']}: entropy calibration of the PP-OCRv4 detector over {args.samples} crops at "
        f"{document['input']}, whole-command wall time, median of {args.rounds} interleaved rounds.",
        "",
        "| setting | median s | runs s | vs one process | same statistics file |",
        "|---|---:|---|---:|---|",
    ]
    for row in rows:
        runs = ", ".join(f"{t:.1f}" for t in row["times_s"])
        same = "yes, byte for byte" if row["identical"] else "NO"
        lines.append(f"| {row['setting']} | {row['median_s']:.2f} | {runs} | {row['ratio']:.2f}x | {same} |")
    two = ceiling["two sessions at once, 1 thread each"]
    gain = sum(1 / t for t in two) * ceiling["one session, 2 threads"][0]
    lines += [
        "",
        f"onnxruntime alone, seconds per crop: one session of 2 threads {ceiling['one session, 2 threads'][0]:.3f}; "
        f"two sessions of 1 thread at once {two[0]:.3f} and {two[1]:.3f} ({gain:.2f}x the throughput).",
    ]
    (RESULTS / "scaleout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
