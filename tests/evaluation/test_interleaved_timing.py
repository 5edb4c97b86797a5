"""Interleaved timing: every block of one session follows a block of another one."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.evaluation.timing import Rounds, time_interleaved


class _RecordingSession:
    """Stands in for an onnxruntime session: each run appends its name to a shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def get_inputs(self) -> list[object]:
        return []

    def run(self, names: object, feed: object) -> list[np.ndarray]:
        self.log.append(self.name)
        return [np.zeros(1, np.float32)]


def _blocks(log: list[str]) -> list[str]:
    """The log collapsed into blocks: consecutive runs of one session count once."""
    return [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]


@pytest.mark.parametrize("count", [2, 3])
def test_no_session_runs_two_timed_blocks_in_a_row(count):
    log: list[str] = []
    names = [f"model {i}" for i in range(count)]
    sessions = {name: _RecordingSession(name, log) for name in names}
    feed = {"x": np.zeros(1, np.float32)}
    times, bound = time_interleaved(sessions, feed, Rounds(9, minimum=9, warmup=2), device=None)  # type: ignore[arg-type]
    assert not bound and all(len(times[name]) == 9 for name in names)
    timed = log[2 * count :]  # after the warm-up runs, one block of one run per session and round
    assert _blocks(timed) == names * 9
    assert all(t > 0 for name in names for t in times[name])


def test_timing_goes_past_its_rounds_only_while_the_comparison_is_undecided_and_within_the_extra_budget():
    log: list[str] = []
    sessions = {name: _RecordingSession(name, log) for name in ("a", "b")}
    feed = {"x": np.zeros(1, np.float32)}
    plan = Rounds(5, minimum=5, warmup=0, extra_count=10)
    settled_after = 8
    undecided = lambda t: {"a", "b"} if len(t["a"]) < settled_after else set()  # noqa: E731
    times, _ = time_interleaved(sessions, feed, plan, unsettled=undecided)  # type: ignore[arg-type]
    assert len(times["a"]) == len(times["b"]) == settled_after  # 3 more rounds, then decided
    times, _ = time_interleaved(sessions, feed, plan, unsettled=lambda t: {"a", "b"})  # type: ignore[arg-type]
    assert len(times["a"]) == 15  # never decided: the 10 extra rounds, no more
    # the extra rounds time only the sessions whose comparison is undecided, still interleaved
    log.clear()
    times, _ = time_interleaved(sessions, feed, plan, unsettled=lambda t: {"b"})  # type: ignore[arg-type]
    assert len(times["a"]) == 5 and len(times["b"]) == 15 and log == ["a", "b"] * 5 + ["b"] * 10
    times, _ = time_interleaved(sessions, feed, plan)  # type: ignore[arg-type]
    assert len(times["a"]) == 5  # no test: the planned rounds
