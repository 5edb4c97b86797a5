"""Interleaved latency of several sessions: the same feed, one run of each per round."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import onnxruntime as ort

from qtool.calibration.dataset import Feed
from qtool.graph.session import run_session, typed_empties


def device_runner(session: ort.InferenceSession, feed: Feed, device: str) -> Callable[[], object] | None:
    """A call that runs ``session`` with inputs and outputs bound on ``device`` (``cuda``, ``cpu``).

    The inputs are copied to the device once; each call then runs without host copies, as a GPU
    application that keeps its tensors on the device does. None when this onnxruntime build cannot
    bind there (a CPU-only build asked for ``cuda``).
    """
    try:
        binding = session.io_binding()
        for name, value in typed_empties(session, feed).items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, 0))
        for output in session.get_outputs():
            binding.bind_output(output.name, device)
        session.run_with_iobinding(binding)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own untyped family when the device is missing
        return None

    def run() -> ort.IOBinding:
        session.run_with_iobinding(binding)
        return binding

    return run


@dataclass(frozen=True)
class Rounds:
    """How long interleaved timing runs: at most ``count`` rounds, fewer once ``seconds`` have passed."""

    count: int
    seconds: float = math.inf  # after this long, stop once ``minimum`` rounds are done
    minimum: int = 3
    warmup: int = 1  # untimed runs of each session first
    block_seconds: float = 0.0  # each sample: back-to-back runs lasting about this long, averaged
    # with an ``unsettled`` test: past ``count`` rounds (or ``seconds``), keep going while it says the
    # comparison that matters is still undecided, for at most this many more rounds and seconds
    extra_count: int = 0
    extra_seconds: float = 0.0


def time_interleaved(
    sessions: Mapping[str, ort.InferenceSession],
    feed: Feed,
    rounds: Rounds,
    *,
    on_round: Callable[[int], None] | None = None,
    device: str | None = None,
    unsettled: Callable[[dict[str, list[float]]], Collection[str]] | None = None,
) -> tuple[dict[str, list[float]], bool]:
    """Seconds per run of each session, one number per round, and whether the runs were device-bound.

    Each round runs every session once, always in the same order, so machine noise (frequency
    changes, other processes) hits every model alike and every block follows another session's
    block. (A rotating order let a session run two blocks in a row every other round; with several
    intra-op threads such a block ran up to 40 % faster than one after a switch, as the scheduler
    had settled its threads, and a byte copy then differed from itself by several per cent.) Timing stops
    after ``rounds.count`` rounds, or once ``rounds.seconds`` have passed and ``rounds.minimum`` are done.
    ``device``: bind inputs and outputs there (see :func:`device_runner`) when every session can.
    ``rounds.block_seconds``: a round runs each session back to back enough times to last about this
    long (the slowest model's warm-up run sets the count, see :func:`runs_per_block`) and records the
    mean: a thread's wake-up or a cache miss in one short run no longer decides the sample.
    ``unsettled``: asked after the planned rounds; while it names sessions whose comparison is still
    undecided, timing goes on for those alone (in the same order), within ``rounds.extra_count`` and
    ``rounds.extra_seconds`` (a slow model gets the rounds its decision needs). A session's list then
    ends with the last round it ran in: round ``i`` of every list that has one is the same round.
    """
    names = list(sessions)
    for name in names:
        for _ in range(rounds.warmup):
            run_session(sessions[name], None, feed, name)
    bound = {name: device_runner(sessions[name], feed, device) for name in names} if device else {}
    runners: dict[str, Callable[[], object]] = {}
    for name in names:
        runner = bound.get(name)
        runners[name] = runner if runner is not None and all(bound.values()) else _plain(sessions[name], feed)
    repeat = runs_per_block(runners, rounds.block_seconds)
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    done, timed = 0, names
    while True:
        elapsed = time.perf_counter() - started
        if done >= rounds.count or (done >= rounds.minimum and elapsed > rounds.seconds):
            over = done >= rounds.count + rounds.extra_count or elapsed > rounds.seconds + rounds.extra_seconds
            pending = set() if unsettled is None or over else set(unsettled(times))
            timed = [name for name in timed if name in pending]
            if not timed:
                break
        done += 1
        for name in timed:
            begin = time.perf_counter()
            for _ in range(repeat):
                runners[name]()
            times[name].append((time.perf_counter() - begin) / repeat)
        if on_round:
            on_round(1)
    return times, bool(bound) and all(bound.values())


MAX_BLOCK_RUNS = 1000


def runs_per_block(runners: Mapping[str, Callable[[], object]], block_seconds: float) -> int:
    """How many back-to-back runs of the slowest model last ``block_seconds`` (at least 1)."""
    if block_seconds <= 0:
        return 1
    slowest = 0.0
    for runner in runners.values():
        begin = time.perf_counter()
        runner()
        slowest = max(slowest, time.perf_counter() - begin)
    return max(1, min(MAX_BLOCK_RUNS, int(block_seconds / max(slowest, 1e-9))))


def _plain(session: ort.InferenceSession, feed: Feed) -> Callable[[], object]:
    fitted = typed_empties(session, feed)  # a decoder's empty cache in the type this session keeps it
    return lambda: session.run(None, fitted)
