"""tune's choice: allocations verified on the selection half, the choice validated on the other.

The run's state (the nodes, the options, the budget and how a candidate is built) comes from the
caller as a :class:`TuneRun`: the pipeline's ``Tuning`` is one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import onnx

from qtool.choice.tune.allocation import allocate, cheaper_moves, costlier_moves, predicted_nsr
from qtool.choice.tune.candidates import Candidates, Goal, node_costs
from qtool.choice.tune.loop import MarginChoice, Margins, Search, Trial, best_trial, refine, search_budgets
from qtool.choice.tune.sensitivity import Sensitivity, nsr
from qtool.choice.tune.space import OPTIONS, Option
from qtool.choice.validated import Validation, ValidationRound, choose_then_validate
from qtool.errors import QtoolError
from qtool.options import TuneOptions
from qtool.progress import ProgressFactory
from qtool.quantization.plan.records import NodePlan
from qtool.system.stages import stage

REFINE_TRIALS_PER_NODE = 3  # verifications the refinement (descent and restarts) may spend, per tuned node
FIRST_METRIC_BUDGET = 1e-3  # noise-to-signal power to start from with a metric goal (30 dB)
VALIDATION_ROUNDS = 5  # choices validated at most (each bound is at the confidence corrected for them all)
MARGIN_STEP_DB = 0.25  # added to an SQNR shortfall, so the next choice is not the one that just missed
MARGIN_RESOLUTION_DB = 0.5  # the margin's bisection stops when the passing and missing margins are this close


class TuneRun(Protocol):
    """What tune's choice reads of the run: the nodes and options, the goal, the clock and the builder."""

    goal: Goal
    space: list[Option]
    tuned: list[NodePlan]  # nodes with a constant weight, largest first
    weight_shape: dict[str, list[int]]
    scoring_seconds: float  # the longest build and scoring of one candidate so far

    @property
    def options(self) -> TuneOptions: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def deadline(self) -> float:
        """When the search must stop (time.monotonic)."""
        ...

    def search_deadline(self) -> float:
        """When the search may start no more candidates."""
        ...

    def scored(self, seconds: float) -> None:
        """Count one candidate's build and scoring."""
        ...

    def build(self, allocation: Mapping[str, Option | str]) -> onnx.ModelProto:
        """The model of an allocation (node -> option)."""
        ...

    def block_axes(self) -> dict[str, int | None]:
        """Each weighted node's per-block axis (the reduction axis)."""
        ...


@dataclass
class Outcome:
    """What the search and the validation found."""

    trials: list[Trial]
    chosen: Trial
    validation: Validation  # of the chosen candidate
    rounds: list[ValidationRound[MarginChoice]]
    margin: float  # the selection margin the last choice was made with (goal units)
    out_of_time: bool
    stalled: bool
    reachable: bool  # some quantized candidate met the target on the selection samples


def timed(options: TuneOptions) -> bool:
    """Whether latency counts (its objective, or a bound): then every candidate is timed."""
    return options.objective == "latency" or options.max_latency_ratio is not None


def _search(
    tuning: TuneRun,
    sens: Sensitivity,
    candidates: Candidates,
    verify: Callable[[dict[str, str]], Trial],
    known: Sequence[Trial] = (),
    refine_trials: int = REFINE_TRIALS_PER_NODE,
) -> Search:
    """Allocations for a shrinking noise budget, verified; then the best one refined (size objective).

    ``known``: trials verified before (judged under the current goal): the refinement starts from the
    best of them and the new ones. ``refine_trials``: verifications the refinement may spend per node.
    """
    options, goal, names = tuning.options, candidates.goal, tuning.names
    option_names = [o.name for o in tuning.space]
    costs = _costs(tuning)
    first = _first_budget(goal)
    search = Search()
    tiers = [option_names]
    if timed(options):  # low-bit weight-only nodes dequantize at run time: the fallback tier runs at float speed
        tiers.append([o for o in option_names if o not in ("w2", "w4")])
    with stage("allocate and verify"):
        for allowed in tiers:

            def allocate_for(budget: float, allowed: list[str] = allowed) -> dict[str, str]:
                return allocate(names, allowed, costs, sens, budget)

            found = search_budgets(
                first,
                allocate_for,
                lambda allocation, budget: verify(allocation),
                goal.slack_db,
                deadline=tuning.search_deadline,
            )
            search.trials += found.trials
            search.out_of_time = search.out_of_time or found.out_of_time
            if best_trial(search.trials, options.objective) is not None or search.out_of_time:
                break
    best = best_trial([*known, *search.trials], options.objective)
    if best is not None and options.objective == "size" and not search.out_of_time:
        with stage("refine the best allocation"):
            refined = refine(
                best,
                lambda allocation, rejected: cheaper_moves(allocation, option_names, costs, sens, rejected),
                verify,
                deadline=tuning.search_deadline,
                max_trials=refine_trials * len(names) + 10,
                upgrades=lambda allocation: costlier_moves(allocation, option_names, costs, sens),
                restart_trials=len(names),
                stall_trials=max(8, len(names) // 4),
            )
        search.trials += refined.trials
        search.out_of_time, search.stalled = refined.out_of_time, refined.stalled
    return search


def _first_budget(goal: Goal) -> float:
    """The noise budget an SQNR goal (and its margin) allows; a metric goal's first guess (30 dB)."""
    return nsr(goal.target_sqnr_db + goal.margin_db) if goal.target_sqnr_db is not None else FIRST_METRIC_BUDGET


def noise_ceiling(goal: Goal) -> float:
    """The most noise any allocation meeting the goal can have (an SQNR goal's budget; unknown for a metric)."""
    return nsr(goal.target_sqnr_db) if goal.target_sqnr_db is not None else math.inf


def _costs(tuning: TuneRun) -> dict[str, dict[str, float]]:
    """Each node's predicted cost of each option (bytes, or time for the latency objective)."""
    return node_costs(
        tuning.names,
        tuning.weight_shape,
        {n.name: n.weight.axis if n.weight is not None else None for n in tuning.tuned},
        tuning.block_axes(),
        {n.name: n.macs or 0 for n in tuning.tuned},
        tuning.options.objective,
        [o.name for o in tuning.space],
        lambda o: OPTIONS[o].integer,
    )


def search_and_validate(
    tuning: TuneRun, sens: Sensitivity, candidates: Candidates, progress: ProgressFactory
) -> Outcome:
    """Select on the selection half, validate the choice on the other; a miss raises the margin and chooses again."""
    objective = tuning.options.objective
    verified: dict[tuple[tuple[str, str], ...], Trial] = {}
    advance = progress("candidates", REFINE_TRIALS_PER_NODE * len(tuning.names) + 30)

    def verify(allocation: dict[str, str]) -> Trial:
        key = tuple(sorted(allocation.items()))
        if key not in verified:
            begun = time.monotonic()
            model = tuning.build(allocation)
            verified[key] = candidates.verify(model, allocation, predicted_nsr(allocation, sens))
            tuning.scored(time.monotonic() - begun)
            advance(1)
        return candidates.judged(verified[key])

    search = _search(tuning, sens, candidates, verify)
    trials, out_of_time, stalled = list(search.trials), search.out_of_time, search.stalled
    reachable = best_trial(trials, objective) is not None
    if not reachable and not any(_quantizes(t) for t in trials):  # the target asks for more than any option gives
        trials.append(verify(_most_accurate_quantized(tuning, sens)))
    choice = _validate_choices(_AtMargins(tuning, sens, candidates, verify, trials, reachable))
    return Outcome(
        choice.trials,
        choice.chosen,
        choice.validation,
        choice.rounds,
        choice.margin,
        out_of_time or choice.out_of_time,
        stalled,
        reachable,
    )


@dataclass
class _Validated:
    """The validation loop's result: the trials (some added), the kept choice and every round."""

    trials: list[Trial]
    chosen: Trial
    validation: Validation
    margin: float
    rounds: list[ValidationRound[MarginChoice]]
    out_of_time: bool


class _AtMargins:
    """tune's choices: the best trial at a selection margin that each validation moves (see :class:`Margins`).

    A new margin allocates and refines again, so the choice there is as small as the first; the kept
    choice is the best whose validation met the goal.
    """

    def __init__(
        self,
        tuning: TuneRun,
        sens: Sensitivity,
        candidates: Candidates,
        verify: Callable[[dict[str, str]], Trial],
        trials: list[Trial],
        reachable: bool,
    ) -> None:
        self.tuning, self.sens, self.candidates, self.verify = tuning, sens, candidates, verify
        self.trials, self.reachable = trials, reachable
        self.margins = Margins(MARGIN_STEP_DB, MARGIN_RESOLUTION_DB)
        self.searched = {0.0}  # margins searched at (the first search's)
        self.kept: tuple[Trial, Validation, float] | None = None  # the best choice whose validation met the goal
        self.validated = False  # a choice was validated (a later one that meets nothing is not tried)
        self.out_of_time = False

    def first(self) -> MarginChoice | None:
        return self._choose()

    def after(self, choice: MarginChoice, validation: Validation) -> MarginChoice | None:
        objective = self.tuning.options.objective
        chosen, self.validated = self.trials[choice.trial], True
        if validation.meets and chosen.meets and (self.kept is None or _better(chosen, self.kept[0], objective)):
            self.kept = (chosen, validation, choice.margin)
        if not chosen.meets:  # the target is out of reach: the most accurate quantized candidate, validated
            self.kept = self.kept or (chosen, validation, choice.margin)
            return None
        shortfall = self.tuning.goal.shortfall(validation.bound_db, validation.metric_bound)
        self.margins.update(validation.meets, shortfall, bisect=not self.tuning.goal.by_metric)
        return self._choose()

    def _choose(self) -> MarginChoice | None:
        """The best trial at the current margin (searched there first when new), or None when none is left."""
        margin = self.margins.margin
        if margin is None:
            return None
        tuning = self.tuning
        self.candidates.goal = replace(tuning.goal, margin_db=margin)
        self.trials = [self.candidates.judged(t) for t in self.trials]
        if self.reachable and margin not in self.searched and time.monotonic() < tuning.deadline:
            more = _search(tuning, self.sens, self.candidates, self.verify, self.trials, refine_trials=1)
            self.trials += [t for t in more.trials if t not in self.trials]
            self.out_of_time = self.out_of_time or more.out_of_time
            self.searched.add(margin)
        chosen = best_trial(self.trials, tuning.options.objective) or (
            None if self.validated else _closest(tuning, self.trials)
        )
        return None if chosen is None else MarginChoice(self.trials.index(chosen), margin)


def _validate_choices(chooser: _AtMargins) -> _Validated:
    """Validate the choice; move the selection margin (see :class:`Margins`) and choose again, up to the limit."""
    tuning, candidates = chooser.tuning, chooser.candidates

    def validate(choice: MarginChoice) -> Validation:
        begun = time.monotonic()
        validation = candidates.validate(tuning.build(chooser.trials[choice.trial].allocation))
        tuning.scored(time.monotonic() - begun)
        return validation

    def may_validate(rounds: Sequence[ValidationRound[MarginChoice]]) -> bool:
        late = time.monotonic() + tuning.scoring_seconds > tuning.deadline  # a round would overrun
        return len(rounds) < VALIDATION_ROUNDS and not (rounds and late)

    with stage("validate the choice"):
        rounds = choose_then_validate(
            chooser,
            validate,
            key=lambda choice: tuple(sorted(chooser.trials[choice.trial].allocation.items())),
            may_validate=may_validate,
        )
    trials = chooser.trials
    if chooser.kept is None:  # every validated choice missed: the last one, reported as missing
        last = rounds[-1]
        chooser.kept = (trials[last.choice.trial], last.validation, last.choice.margin)
    chosen, validation, margin = chooser.kept
    candidates.goal = replace(tuning.goal, margin_db=margin)  # the trials as judged when the kept one was chosen
    trials = [candidates.judged(t) for t in trials]
    chosen = next(t for t in trials if t.allocation == chosen.allocation)
    return _Validated(trials, chosen, validation, margin, rounds, chooser.out_of_time)


def _better(trial: Trial, than: Trial, objective: str) -> bool:
    """Whether ``trial`` is preferred to ``than`` (both meeting the goal) under the objective."""
    return best_trial([than, trial], objective) is trial


def _quantizes(trial: Trial) -> bool:
    return any(option != "float" for option in trial.allocation.values())


def _most_accurate_quantized(tuning: TuneRun, sens: Sensitivity) -> dict[str, str]:
    """Each node's least noisy option other than float (the cheaper of equals): the best a quantized model does."""
    costs = _costs(tuning)
    usable = [o.name for o in tuning.space if o.name != "float"]
    chosen = {}
    for node in tuning.names:
        ranked = sorted((sens.of(node, o), costs[node][o], o) for o in usable)
        chosen[node] = ranked[0][2]
    return chosen


def _closest(tuning: TuneRun, trials: list[Trial]) -> Trial:
    """When no trial meets the target: the most accurate one that quantizes something."""
    quantized = [t for t in trials if _quantizes(t)] or trials
    if not quantized:
        raise QtoolError(
            f"--time-budget {tuning.options.time_budget:g} s ran out before any candidate was verified",
            hint="give a larger --time-budget",
        )
    sign = -1 if tuning.goal.lower_is_better else 1
    return max(quantized, key=lambda t: (t.metric_bound if t.metric_bound is not None else t.bound_db) * sign)
