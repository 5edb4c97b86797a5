"""The verification loop: allocate for a noise budget, build and measure for real, move the budget.

The predicted noise is a first-order sum; the measured model decides. Each round allocates for a
budget, verifies the allocation (a real build, scored on the evaluation samples), and moves the
budget: up when the model meets the target (a smaller model may too), down when it does not, by
the measured slack in dB while only one side is known, then by bisection between the largest
budget that met the target and the smallest that did not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from qtool.choice.tune.allocation import Allocation


@dataclass(frozen=True)
class Trial:
    """One allocation built and measured; its report (:class:`qtool.schemas.tune.TuneTrial`) is read from it."""

    allocation: dict[str, str]  # node -> option name
    predicted_sqnr_db: float  # the SQNR the sum of its nodes' measured noise predicts
    size_bytes: int
    compression_ratio: float
    sqnr_db: float  # worst output on the selection samples, pooled
    bound_db: float = math.nan  # its lower confidence bound (what the target is judged on)
    metric: float | None = None  # the user's metric (mean), when given
    metric_bound: float | None = None  # its confidence bound (the worse side)
    latency_ratio: float | None = None  # candidate / float time, when timed
    latency_ratio_interval: tuple[float, float] | None = None
    meets: bool = False  # accuracy target met (and the latency bound, when given)
    note: str = ""  # why it does not meet the target
    # set when tune's result is made (see :func:`marked`): the trial chosen (and the written model), and whether
    # it is on the Pareto front of the trials
    chosen: bool = False
    pareto: bool = False

    @property
    def precisions(self) -> dict[str, int]:
        """How many nodes got each option."""
        found: dict[str, int] = {}
        for option in self.allocation.values():
            found[option] = found.get(option, 0) + 1
        return dict(sorted(found.items()))


@dataclass
class Search:
    """The trials so far and whether the time budget cut the loop short."""

    trials: list[Trial] = field(default_factory=list)
    out_of_time: bool = False
    stalled: bool = False  # the refinement stopped: its last verifications no longer paid for themselves


# When a search must stop (a ``time.monotonic()`` value), or a function giving it as it moves (an estimate of
# what the work after the search costs grows as candidates are timed)
Deadline = float | Callable[[], float]


def past(deadline: Deadline) -> bool:
    """Whether ``deadline`` has passed."""
    return time.monotonic() > (deadline() if callable(deadline) else deadline)


def search_budgets(
    first_budget: float,
    allocate: Callable[[float], Allocation],
    verify: Callable[[Allocation, float], Trial],
    slack_db: Callable[[Trial], float | None],
    *,
    deadline: Deadline,
    max_trials: int = 10,
) -> Search:
    """Verify allocations for moving budgets (noise-to-signal power) until the best is pinned down.

    ``slack_db``: how far a trial is above (+) or below (-) its accuracy target in dB, when that is
    known (an SQNR target); None moves the budget by a factor of 4 while one side is unknown.
    """
    search = Search()
    seen: dict[tuple[tuple[str, str], ...], Trial] = {}
    budget, met, missed = first_budget, 0.0, math.inf
    repeats = 0
    for _ in range(max_trials):
        if search.trials and past(deadline):  # one candidate is always verified
            search.out_of_time = True
            break
        allocation = allocate(budget)
        key = tuple(sorted(allocation.items()))
        trial = seen.get(key)
        if trial is None:
            trial = verify(allocation, budget)
            seen[key] = trial
            search.trials.append(trial)
            repeats = 0
        else:
            repeats += 1
        # A missed allocation's own predicted noise bounds the budget that could choose it again.
        spent = 10 ** (-trial.predicted_sqnr_db / 10) if math.isfinite(trial.predicted_sqnr_db) else budget
        if trial.meets:
            met = max(met, budget)
        else:
            missed = min(missed, budget, spent)
        if repeats >= 3 or (met > 0 and math.isfinite(missed) and missed / met < 1.5):
            break
        if met > 0 and math.isfinite(missed):
            budget = math.sqrt(met * missed)
            continue
        slack = slack_db(trial)
        factor = 10 ** (slack / 10) if slack is not None and math.isfinite(slack) else (4.0 if trial.meets else 0.25)
        factor = min(max(factor, 1.5), 100.0) if trial.meets else max(min(factor, 1 / 1.5), 0.01)
        budget = budget * factor if trial.meets else min(budget * factor, spent / 1.5)
    return search


Moves = Callable[[Allocation, set[tuple[str, str]]], list[tuple[str, str]]]
RESTARTS = 3  # upgrades tried per round, each with its own descent
MIN_GAIN = 0.0025  # of the model's size: what the refinement's last verifications must save to go on


def refine(
    start: Trial,
    moves: Moves,
    verify: Callable[[Allocation], Trial],
    *,
    deadline: Deadline,
    max_trials: int,
    upgrades: Callable[[Allocation], list[tuple[str, str]]] | None = None,
    restart_trials: int = 0,
    stall_trials: int = 8,
) -> Search:
    """Greedy descent from a trial that meets the target, then restarts from one node made more accurate.

    ``moves(allocation, rejected)`` lists (node, cheaper option) steps, the best exchange of saved cost
    for added noise first, leaving out the rejected ones. They are tried in batches (a quarter of them
    at first); a batch that breaks the target is halved, and a single step that breaks it is rejected
    (its node then offers its next cheaper option). Each kept batch makes the model smaller.

    A descent stops where no single cheaper step keeps the target, but a step that breaks it may pass
    once another node is more accurate. ``upgrades(allocation)`` lists (node, costlier option) steps,
    the most noise removed per byte added first: each of the first ``RESTARTS`` that meets the target
    starts a new descent of at most ``restart_trials`` verifications (the upgraded node may not go back),
    and the first that ends smaller replaces the best, for as long as trials and time remain. No
    allocation is verified twice.

    The refinement costs what it can gain: once the last ``stall_trials`` verifications together made the
    best model less than :data:`MIN_GAIN` (a fraction of its size) smaller, it stops (``stalled``).
    """
    search = Search()
    check = _Verifier(search, verify, (deadline, max_trials), (stall_trials, MIN_GAIN), start)
    best = _descend(start, moves, check, set(), max_trials)
    while upgrades is not None and restart_trials > 0:
        for node, option in upgrades(best.allocation)[:RESTARTS]:
            trial = check({**best.allocation, node: option})
            if trial is None:
                return search
            if not trial.meets:
                continue
            found = _descend(trial, moves, check, {(node, best.allocation[node])}, restart_trials)
            if found.size_bytes < best.size_bytes:
                best = found
                break
        else:
            return search
    return search


class _Verifier:
    """Verifies each allocation once, while trials, time and gains last (see :func:`refine`)."""

    def __init__(
        self,
        search: Search,
        verify: Callable[[Allocation], Trial],
        limits: tuple[Deadline, int],
        stall: tuple[int, float],
        start: Trial,
    ) -> None:
        self.search, self.verify = search, verify
        (self.deadline, self.max_trials), (self.stall_trials, self.min_gain) = limits, stall
        self.seen: dict[tuple[tuple[str, str], ...], Trial] = {tuple(sorted(start.allocation.items())): start}
        self.best_sizes = [start.size_bytes]  # the smallest meeting size after each verification

    def __call__(self, allocation: Allocation) -> Trial | None:
        """The allocation's trial (verified once); None when trials, time or gains have run out."""
        key = tuple(sorted(allocation.items()))
        if key in self.seen:
            return self.seen[key]
        if len(self.search.trials) >= self.max_trials:
            return None
        if past(self.deadline):
            self.search.out_of_time = True
            return None
        sizes, stall = self.best_sizes, self.stall_trials
        if len(sizes) > stall and sizes[-stall - 1] - sizes[-1] < self.min_gain * sizes[-1]:
            self.search.stalled = True
            return None
        self.seen[key] = trial = self.verify(allocation)
        self.search.trials.append(trial)
        sizes.append(min(sizes[-1], trial.size_bytes) if trial.meets else sizes[-1])
        return trial


def _descend(
    start: Trial,
    moves: Moves,
    check: Callable[[Allocation], Trial | None],
    rejected: set[tuple[str, str]],
    limit: int,
) -> Trial:
    """The greedy descent from ``start``: the smallest trial it reached that meets the target."""
    current, spent = start, 0
    pending = moves(current.allocation, rejected)
    batch = max(1, len(pending) // 4)
    while pending and spent < limit:
        step = pending[:batch]
        trial = check({**current.allocation, **dict(step)})
        if trial is None:
            break
        spent += 1
        if trial.meets and trial.size_bytes < current.size_bytes:
            current = trial
            pending = moves(current.allocation, rejected)
        elif batch > 1:
            batch = max(1, batch // 2)
        else:
            rejected.add(step[0])
            pending = moves(current.allocation, rejected)
    return current


def best_trial(trials: list[Trial], objective: str) -> Trial | None:
    """The smallest (``size``) or fastest (``latency``) trial that meets the target; ties to accuracy."""
    meeting = [t for t in trials if t.meets]
    if objective == "latency":
        return min(meeting, key=lambda t: (t.latency_ratio or math.inf, t.size_bytes, -t.sqnr_db), default=None)
    return min(meeting, key=lambda t: (t.size_bytes, -t.sqnr_db), default=None)


def pareto(trials: list[Trial]) -> list[Trial]:
    """The trials no other trial beats on size, accuracy and (when timed) latency at once."""

    def beats(a: Trial, b: Trial) -> bool:
        la, lb = a.latency_ratio or 0.0, b.latency_ratio or 0.0
        no_worse = a.size_bytes <= b.size_bytes and a.sqnr_db >= b.sqnr_db and la <= lb
        return no_worse and (a.size_bytes < b.size_bytes or a.sqnr_db > b.sqnr_db or la < lb)

    return sorted((t for t in trials if not any(beats(o, t) for o in trials)), key=lambda t: t.size_bytes)


def marked(trials: list[Trial], chosen: Trial) -> tuple[list[Trial], Trial]:
    """The trials with ``chosen`` and ``pareto`` set, and the chosen one (a trial listed twice stays one object)."""
    front = {id(t) for t in pareto(trials)}
    by_id = {id(t): replace(t, chosen=t is chosen, pareto=id(t) in front) for t in trials}
    return [by_id[id(t)] for t in trials], by_id.get(id(chosen), replace(chosen, chosen=True))


@dataclass(frozen=True)
class MarginChoice:
    """One of tune's choices: the trial chosen, and the selection margin it was chosen with (goal units)."""

    trial: int  # position in the trials
    margin: float


@dataclass
class Margins:
    """The selection margin, moved by each validation: up by the shortfall until a choice passes, then bisected.

    A margin whose choice passed bounds the search from above, one whose choice missed from below;
    between them the margin is halved until the two are within ``resolution``. Without ``bisect``
    (a metric goal) it stops at the first pass. ``margin`` is None once nothing is left to try.
    """

    step: float  # added to a shortfall, so the next choice is not the one that just missed
    resolution: float
    margin: float | None = 0.0
    missed: float | None = None  # the largest margin whose choice missed
    passed: float | None = None  # the smallest margin whose choice passed

    def update(self, met: bool, shortfall: float, *, bisect: bool = True) -> None:
        """Record how the choice made at ``margin`` validated, and move to the next margin to try."""
        assert self.margin is not None  # updated only while there is a margin to try
        if met:
            self.passed = self.margin
        else:
            self.missed = self.margin
        if self.passed is None:
            assert self.missed is not None
            self.margin = self.missed + shortfall + (self.step if bisect else 0.0)
            if not self.margin > self.missed:  # no shortfall to move by (an undefined bound): nothing new to try
                self.margin = None
        elif self.missed is None or not bisect or self.passed - self.missed < self.resolution:
            self.margin = None
        else:
            self.margin = (self.missed + self.passed) / 2
