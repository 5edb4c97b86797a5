"""Interleaved latency of several sessions: the same feed, one run of each per round."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import onnxruntime as ort

from qtool.calibration.dataset import Feed
from qtool.graph.session import run_session


def time_interleaved(
    sessions: Mapping[str, ort.InferenceSession],
    feed: Feed,
    *,
    rounds: int,
    seconds: float,
    min_rounds: int = 3,
    warmup: int = 1,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of every timed run of each session.

    Each round runs every session once, in an order that rotates from round to round, so
    machine noise (frequency changes, other processes) hits every model alike. Timing stops
    after ``rounds`` rounds, or once ``seconds`` have passed and ``min_rounds`` are done.
    """
    names = list(sessions)
    for name in names:
        for _ in range(warmup):
            run_session(sessions[name], None, feed, name)
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    for done in range(rounds):
        if done >= min_rounds and time.perf_counter() - started > seconds:
            break
        shift = done % len(names)
        for name in names[shift:] + names[:shift]:
            begin = time.perf_counter()
            sessions[name].run(None, feed)
            times[name].append(time.perf_counter() - begin)
        if on_round:
            on_round(1)
    return times
