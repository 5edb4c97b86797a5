"""The placement a model ships with, chosen by measurement: accuracy on samples, then latency.

The MAC model of :mod:`qtool.quantization.placement` guesses where integer kernels pay off;
whether they do depends on the CPU, onnxruntime's fusions and the shapes. So ``quantize``
builds a few candidates and measures them:

- ``auto``: the placement rules of the config;
- ``integer``: every ``placement: auto`` node an integer kernel (what fast int8 CPUs want);
- ``storage``: every ``auto`` node storage-only (weights stored quantized, float compute);
- ``dynamic``: ``auto`` with every integer MatMul/Gemm quantizing its input at run time
  (``mode: dynamic``), built when such nodes do most of the model's work (transformers);
- ``search``: ``auto`` plus the float activations the sensitivity search chose
  (:mod:`qtool.quantization.search`), when ``auto`` misses the target.

Each distinct candidate is scored on the same samples (the worst output's SQNR), then the
float model and the candidates are timed interleaved. Of the candidates that reach the target,
the most accurate is kept unless another is *decisively* faster: faster by more than :data:`TIE`
at the upper end of a :data:`DECISIVE_CONFIDENCE` order-statistic interval of the round-by-round
latency ratios. Then that one is kept (the most accurate of several), and the rule repeats from
it. Timing noise between near-equal candidates therefore never changes the model written: the
same inputs give the same bytes unless a candidate's speed sits right at the margin. When none
reaches the target, the most accurate candidate is kept. Storage-only runs at float speed, so
the choice is never meaningfully slower than fp32 when storage reaches the target.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import onnx

from qtool.calibration.dataset import Dataset, Feed
from qtool.calibration.outputs import FloatOutputs
from qtool.config import QConfig
from qtool.evaluation.confidence import CONFIDENCE
from qtool.evaluation.intervals import median_interval
from qtool.evaluation.scoring import OutputScorer, signal_means
from qtool.evaluation.timing import Rounds, time_interleaved
from qtool.graph.session import create_session
from qtool.graph.weights import Weights
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.plan_types import QuantPlan
from qtool.quantization.search import FLOAT, FLOAT_ACTIVATIONS, SearchResult, sensitivity_search

TIE = 0.05  # a candidate must be more than 5 % faster to displace a more accurate one
DECISIVE_CONFIDENCE = 0.9  # two-sided interval of the median ratio (one-sided 95 %); needs 5+ rounds
TIMING_SECONDS = 3.0  # timing stops after this long once MIN_ROUNDS rounds are done
MIN_ROUNDS = 5
DYNAMIC_MIN_SHARE = 0.5  # the dynamic candidate is built when weighted MatMul/Gemm do this share of the MACs
TIMING_MAX_BYTES = 1 << 30  # the float model's bytes times the sessions timed together; past it, no timing
SEARCH_COST_FACTOR = 2.0  # the search's time budget: this many times what the candidates cost to measure


class Build(Protocol):
    """Plans and rewrites the model of a config; ``keep``: remembered, so writing it later costs nothing."""

    def __call__(self, config: QConfig, /, keep: bool = True) -> tuple[QuantPlan, onnx.ModelProto]: ...


@dataclass(frozen=True)
class PlacementCandidate:
    """One placement the choice measured."""

    name: str  # auto | integer | storage | dynamic | search
    same_as: tuple[str, ...]  # other candidates that planned exactly this placement
    integer_nodes: int
    storage_nodes: int
    sqnr_db: float  # the worst output's SQNR on the scored samples
    meets_target: bool
    latency_ms: float | None = None  # median at the choice's thread count (None: not timed)


@dataclass(frozen=True)
class PlacementValidation:
    """A placement scored on samples the choice never scored: the figure it promises."""

    candidate: str
    samples: list[str]
    sqnr_db: float  # worst output, the validation samples pooled
    bound_db: float  # its lower confidence bound (per-sample spread)
    meets_target: bool  # the bound reaches the target


@dataclass
class PlacementChoice:
    """What the placement choice measured and what it kept."""

    target_sqnr_db: float
    samples: list[str]  # the files scored, spread over the data
    threads: int
    candidates: list[PlacementCandidate]
    chosen: str
    reason: str
    fp32_ms: float | None = None
    timing_note: str = ""
    search: SearchResult | None = None
    search_note: str = ""  # why no search ran, when it could have
    times: dict[str, list[float]] = field(default_factory=dict, repr=False)  # seconds per run, fp32 included
    validations: list[PlacementValidation] = field(default_factory=list)  # the kept one's is the last
    confidence: float = CONFIDENCE  # of the validation bounds

    @property
    def validation(self) -> PlacementValidation | None:
        """The kept placement's validation (None: too few samples to hold any out)."""
        return next((v for v in reversed(self.validations) if v.candidate == self.chosen), None)

    @property
    def chosen_candidate(self) -> PlacementCandidate:
        return next(c for c in self.candidates if c.name == self.chosen)

    def speedup(self, candidate: PlacementCandidate) -> float | None:
        """fp32 median / the candidate's median (None when not timed)."""
        if candidate.latency_ms is None or self.fp32_ms is None or candidate.latency_ms <= 0:
            return None
        return self.fp32_ms / candidate.latency_ms

    @property
    def expects_speedup(self) -> bool:
        """Whether the kept placement runs integer kernels that measured faster than fp32."""
        chosen = self.chosen_candidate
        speedup = self.speedup(chosen)
        return chosen.integer_nodes > 0 and (speedup is None or speedup > 1 + TIE)


def _matmul_heavy(plan: QuantPlan) -> bool:
    """Whether MatMul/Gemm nodes with a constant weight do most of the integer work (a transformer's shape).

    Only then is the ``dynamic`` candidate built: onnxruntime fuses dynamic quantization for them alone.
    """
    work = [(n.macs or 0, n.op_type in ("MatMul", "Gemm") and n.weight is not None) for n in plan.nodes]
    total = sum(macs for macs, _ in work)
    return total > 0 and sum(macs for macs, matmul in work if matmul) >= DYNAMIC_MIN_SHARE * total


def _signature(plan: QuantPlan) -> tuple[tuple[str, str], ...]:
    return tuple((n.name, n.placement) for n in plan.nodes)


def _movable(plan: QuantPlan, moves: str = FLOAT_ACTIVATIONS) -> set[str]:
    """The nodes the search may move: only those placed by "auto" (an explicit placement is the user's).

    Float activations only change integer nodes; moving to float changes storage-only nodes too.
    """
    placements = ("integer",) if moves == FLOAT_ACTIVATIONS else ("integer", "storage")
    return {
        n.name
        for n in plan.nodes
        if n.placement in placements and (n.scheme.placement == "auto" or n.scheme.rule.startswith("choice:"))
    }


def _meets(sqnr: float, target: float) -> bool:
    return not math.isnan(sqnr) and sqnr >= target


@dataclass(frozen=True)
class FloatModel:
    """The float model the candidates are measured against."""

    path: Path  # the file, timed as fp32 as ``compare`` times it
    prepared: onnx.ModelProto  # the prepared model the candidates were built from
    weights: Weights  # the detached values the models use
    elements: dict[str, int]  # per-sample element counts of tensors


@dataclass(frozen=True)
class Samples:
    """The samples the choice reads."""

    scored: Dataset  # every candidate is scored on these (the selection samples)
    ranked: Dataset  # the search's per-layer pass
    known: FloatOutputs | None = None  # float outputs calibration kept (see :mod:`qtool.calibration.outputs`)
    validation: Dataset | None = None  # samples no candidate is scored on: the kept one is validated there


def measure_placements(
    float_model: FloatModel,
    config: QConfig,
    build: Build,
    samples: Samples,
    *,
    threads: int | None,
    progress: ProgressFactory | None = None,
) -> tuple[QConfig, PlacementChoice]:
    """Measure the candidate placements of ``config`` and return the config of the one to keep.

    Args:
        float_model: the float model, its weights and tensor sizes.
        config: the configuration; its ``accuracy:`` section sets the target and the budgets.
        build: plans and rewrites the model for a config.
        samples: what the candidates are scored on and the search ranks nodes on.
        threads: onnxruntime intra-op threads for timing (None: 1, the most stable measure).
        progress: receives progress updates.
    """
    settings = config.accuracy
    target = settings.target_sqnr_db if settings.target_sqnr_db is not None else -math.inf
    factory = progress or noop_progress
    dataset = samples.scored
    scorer = OutputScorer(
        float_model.prepared,
        dataset,
        weights=float_model.weights,
        on_sample=factory("float outputs", len(dataset)),
        known=samples.known,
    )
    started = time.perf_counter()
    built = _Built()
    built.add("auto", config, build)
    integer = built.add("integer", replace(config, auto_placement="integer"), build)
    built.add("storage", replace(config, auto_placement="storage"), build)
    if _matmul_heavy(integer):
        built.add("dynamic", replace(config, auto_placement="dynamic"), build)
    built.score(scorer, factory("placements", len(built.plans)))
    choice = PlacementChoice(target, scorer.files, threads or 1, built.candidates(target), "auto", "")
    timed = settings.latency_runs > 0 and len(built.plans) > 1 and bool(scorer.samples)

    def time_all(names: list[str] | None = None) -> None:  # timed on the first scored sample
        plans = built.plans if names is None else {n: built.plans[n] for n in names}
        _time_candidates(choice, float_model, plans, settings.latency_runs, scorer.samples[0][1], factory)

    if timed:
        time_all()
    search_plan = _search_plan(choice, built, timed) if settings.target_sqnr_db is not None else None
    if search_plan is not None:
        # The search may cost at most SEARCH_COST_FACTOR times what building, scoring and timing the
        # candidates did (and never more than accuracy.search_seconds): it can only refine them.
        budget = min(settings.search_seconds, SEARCH_COST_FACTOR * (time.perf_counter() - started))
        bounded = replace(config, accuracy=replace(settings, search_seconds=budget))
        added = _search(choice, built, bounded, build, scorer, samples, float_model, progress, search_plan)
        if added and timed and choice.fp32_ms is not None and _may_win(choice, "search"):
            # time the new candidate with fp32 and every candidate that can be kept: the decision compares
            # those on paired rounds; the others keep their first measurement
            time_all([c.name for c in choice.candidates if c.name == "search" or c.meets_target])
    scorer.release()
    _decide(choice)
    if samples.validation is not None and len(samples.validation) > 0 and settings.target_sqnr_db is not None:
        _validate(choice, built, samples, float_model, factory, scorer)
    return built.configs[choice.chosen], choice


def _validate(
    choice: PlacementChoice,
    built: _Built,
    samples: Samples,
    float_model: FloatModel,
    factory: ProgressFactory,
    scored: OutputScorer,
) -> None:
    """Score the kept placement on the validation samples; when its bound misses the target, try the most accurate.

    The most accurate placement that reached the target on the scored samples replaces the kept one
    only when it reaches the target on the validation samples too (robust before fast).
    """
    assert samples.validation is not None  # checked by the caller
    scorer = OutputScorer(
        float_model.prepared,
        samples.validation,
        weights=float_model.weights,
        on_sample=factory("validation samples", len(samples.validation)),
        known=samples.known,
    )
    target = choice.target_sqnr_db
    signal = signal_means([scored, scorer])  # the float outputs' energy over every sample at hand

    def check(name: str) -> PlacementValidation:
        score = scorer.score(built.plans[name][1], f"the '{name}' placement")
        bound = score.worst_bound_db(choice.confidence, signal)
        found = PlacementValidation(name, list(scorer.files), score.worst_db, bound, _meets(bound, target))
        choice.validations.append(found)
        return found

    kept = check(choice.chosen)
    safer = [c for c in choice.candidates if c.meets_target and c.sqnr_db > choice.chosen_candidate.sqnr_db]
    if not kept.meets_target and safer:
        most_accurate = max(safer, key=lambda c: (c.sqnr_db, -choice.candidates.index(c)))
        if check(most_accurate.name).meets_target:
            choice.chosen = most_accurate.name
            choice.reason = (
                f"the most accurate placement that reaches {target:g} dB: the faster '{kept.candidate}' reached it on "
                f"the scored samples but not on {len(kept.samples)} others ({kept.bound_db:.2f} dB, "
                f"{choice.confidence:.0%} bound)"
            )
    scorer.release()


@dataclass
class _Built:
    """The candidates built so far: each name's config, the distinct plans, and which names planned the same."""

    configs: dict[str, QConfig] = field(default_factory=dict)
    plans: dict[str, tuple[QuantPlan, onnx.ModelProto]] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # first name of a plan -> the others
    scores: dict[str, float] = field(default_factory=dict)  # by distinct plan: the worst output's SQNR
    seen: dict[tuple[tuple[str, str], ...], str] = field(default_factory=dict)

    def add(self, name: str, config: QConfig, build: Build) -> QuantPlan:
        """Build ``config``; a plan built before under another name only records the alias."""
        self.configs[name] = config
        plan, model = build(config)
        first = self.seen.setdefault(_signature(plan), name)
        if first != name:
            self.aliases[first].append(name)
        else:
            self.plans[name], self.aliases[name] = (plan, model), []
        return plan

    def score(self, scorer: OutputScorer, advance: Callable[[int], None]) -> None:
        """Score every distinct candidate not scored yet."""
        for name, (_, model) in self.plans.items():
            if name not in self.scores:
                self.scores[name] = scorer.score(model, f"the '{name}' placement").worst_db
                advance(1)

    def candidates(self, target: float) -> list[PlacementCandidate]:
        return _candidates(self.plans, self.aliases, self.scores, target)


def _search_plan(choice: PlacementChoice, built: _Built, timed: bool) -> tuple[str, str] | None:
    """Where the sensitivity search starts and how it moves nodes, or None when it cannot pay off.

    It runs when "auto" misses the target. When storage-only reaches it, the search gives float
    activations to the integer nodes that cost the most (its model runs between "auto" and storage,
    so only when "auto" measured faster than storage). When even storage-only misses it, the weights'
    rounding is part of the error: the search keeps whole nodes float, starting from "auto" when that
    measured faster than storage, else from storage.
    """
    target = choice.target_sqnr_db
    storage_name = next((n for n, a in built.aliases.items() if n == "storage" or "storage" in a), None)
    if _meets(built.scores["auto"], target):
        return None
    storage_meets = storage_name is None or _meets(built.scores[storage_name], target)
    auto_faster = not timed or choice.fp32_ms is None or _faster_than_storage(choice, storage_name)
    if storage_meets:
        if not auto_faster:
            choice.search_note = "no search: the integer kernels measured no faster than storage-only here"
            return None
        return "auto", FLOAT_ACTIVATIONS
    return ("auto" if auto_faster or storage_name is None else storage_name), FLOAT


def _search(
    choice: PlacementChoice,
    built: _Built,
    config: QConfig,
    build: Build,
    scorer: OutputScorer,
    samples: Samples,
    float_model: FloatModel,
    progress: ProgressFactory | None,
    plan: tuple[str, str],
) -> bool:
    """Run the sensitivity search from the start ``plan`` names; True when it added a "search" candidate."""
    start, moves = plan
    start_plan, start_model = built.plans[start]

    def movable(cfg: QConfig) -> tuple[onnx.ModelProto, set[str]]:
        plan, model = build(cfg, keep=False)  # a trial: only the search's result may be written
        return model, _movable(plan, moves)

    searched, choice.search = sensitivity_search(
        float_model.prepared,
        replace(built.configs[start], accuracy=config.accuracy),  # the search's budget, from the caller
        movable,
        scorer,
        samples.ranked,
        elements=float_model.elements,
        progress=progress,
        initial=(start_model, _movable(start_plan, moves), built.scores[start]),
        moves=moves,
    )
    if choice.search is not None:
        choice.search.start = start
    if choice.search is None or not choice.search.float_nodes:
        return False
    built.configs["search"] = searched
    built.plans["search"], built.aliases["search"] = build(searched), []
    built.scores["search"] = choice.search.final_sqnr_db
    timed = {c.name: c.latency_ms for c in choice.candidates}  # kept until (unless) all are timed again
    choice.candidates = [replace(c, latency_ms=timed.get(c.name)) for c in built.candidates(choice.target_sqnr_db)]
    return True


def _may_win(choice: PlacementChoice, name: str) -> bool:
    """Whether candidate ``name`` could be kept: it reaches the target, or none does and it is the most accurate."""
    candidate = next(c for c in choice.candidates if c.name == name)
    if candidate.meets_target:
        return True
    return not any(c.meets_target for c in choice.candidates) and candidate.sqnr_db >= max(
        c.sqnr_db for c in choice.candidates
    )


def _candidates(
    plans: dict[str, tuple[QuantPlan, onnx.ModelProto]],
    aliases: dict[str, list[str]],
    scores: dict[str, float],
    target: float,
) -> list[PlacementCandidate]:
    return [
        PlacementCandidate(
            name,
            tuple(aliases[name]),
            sum(1 for n in plan.nodes if n.placement in ("integer", "dynamic")),
            sum(1 for n in plan.nodes if n.placement == "storage"),
            scores[name],
            _meets(scores[name], target),
        )
        for name, (plan, _) in plans.items()
    ]


def _faster_than_storage(choice: PlacementChoice, storage_name: str | None) -> bool:
    """Whether "auto" measured decisively faster than storage-only (True when untimed)."""
    if storage_name is None or "auto" not in choice.times or storage_name not in choice.times:
        return True
    return decisively_faster(choice.times, "auto", storage_name)


def decisively_faster(times: dict[str, list[float]], fast: str, slow: str) -> bool:
    """Whether ``fast`` beat ``slow`` by more than :data:`TIE`, judged on the paired rounds.

    Rounds are interleaved, so round ``i`` of both met the same machine: the ratio of each pair is
    one sample, and the upper end of the median ratio's :data:`DECISIVE_CONFIDENCE` interval must
    lie below ``1 - TIE``. Too few rounds for that interval: not decisive.
    """
    ratios = [f / s for f, s in zip(times.get(fast, []), times.get(slow, []), strict=False) if s > 0]
    interval = median_interval(ratios, DECISIVE_CONFIDENCE)
    return interval is not None and interval[1] < 1 - TIE


def _time_candidates(
    choice: PlacementChoice,
    float_model: FloatModel,
    plans: dict[str, tuple[QuantPlan, onnx.ModelProto]],
    rounds: int,
    feed: Feed,
    factory: ProgressFactory,
) -> None:
    """Time fp32 and the candidates of ``plans`` interleaved (in place: latency_ms, fp32_ms, times, timing_note)."""
    model_path, weights = float_model.path, float_model.weights
    size = model_path.stat().st_size + sum(weights.nbytes(model) for _, model in plans.values())
    if size * (len(plans) + 1) > TIMING_MAX_BYTES:
        choice.timing_note = "not timed: the sessions together would take more than 1 GiB"
        return
    threads = choice.threads
    sessions = {"fp32": create_session(model_path, "the float model", threads=threads)}
    for name, (_, model) in plans.items():
        # Timed as written: weights embedded, so onnxruntime folds and prepacks them as it will at load.
        sessions[name] = create_session(weights.embedded(model), f"the '{name}' placement", threads=threads)
    plan = Rounds(rounds, seconds=TIMING_SECONDS, minimum=min(MIN_ROUNDS, rounds))
    times, _ = time_interleaved(sessions, feed, plan, on_round=factory("timing", rounds))
    retimed = choice.fp32_ms is not None and any(c.name not in times for c in choice.candidates)
    choice.times = {**choice.times, **times}
    if not retimed:
        choice.fp32_ms = statistics.median(times["fp32"]) * 1e3
    first_fp32 = choice.fp32_ms
    assert first_fp32 is not None  # set above or by the first pass

    def latency(name: str) -> float:
        if not retimed:
            return statistics.median(times[name]) * 1e3
        # a later pass over some candidates: each round's ratio to fp32 (paired, so the machine's drift between
        # the passes cancels) times the first pass's fp32, so every row's speed-up reads against the same fp32
        return first_fp32 * statistics.median(t / f for t, f in zip(times[name], times["fp32"], strict=False) if f > 0)

    choice.candidates = [replace(c, latency_ms=latency(c.name)) if c.name in times else c for c in choice.candidates]


def _decide(choice: PlacementChoice) -> None:
    """Set ``chosen`` and ``reason`` from the measurements."""
    candidates = choice.candidates
    meeting = [c for c in candidates if c.meets_target]
    # a candidate that could not win is not always timed (see _may_win): only the reaching ones must be
    timed = all(c.latency_ms is not None and c.name in choice.times for c in meeting)
    target = f"{choice.target_sqnr_db:g} dB"
    if not meeting:
        best = max(candidates, key=lambda c: (c.sqnr_db, -candidates.index(c)))
        choice.chosen = best.name
        choice.reason = f"no placement reaches {target} on the scored samples: the most accurate is kept"
    elif not timed:
        preference = ["search", "auto", "integer", "dynamic", "storage"]
        choice.chosen = min(meeting, key=lambda c: preference.index(c.name)).name
        choice.reason = f"reaches {target} (not timed: {choice.timing_note or 'timing is off'})"
    else:
        best = max(meeting, key=lambda c: (c.sqnr_db, -candidates.index(c)))
        start = best
        while True:  # ends: "decisively faster" is transitive round by round, so no cycle
            faster = [c for c in meeting if c is not best and decisively_faster(choice.times, c.name, best.name)]
            if not faster:
                break
            best = max(faster, key=lambda c: (c.sqnr_db, -candidates.index(c)))
        choice.chosen = best.name
        if best is start:
            others = "the only placement" if len(meeting) == 1 else f"the most accurate of {len(meeting)} placements"
            choice.reason = f"{others} that reach {target}" + (
                f"; none measured more than {TIE:.0%} faster" if len(meeting) > 1 else ""
            )
        else:
            choice.reason = (
                f"reaches {target} and measured more than {TIE:.0%} faster than the more accurate placements"
                f" ({DECISIVE_CONFIDENCE:.0%} interval over {len(choice.times[best.name])} interleaved rounds)"
            )
