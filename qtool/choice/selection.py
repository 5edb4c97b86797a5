"""The placement a model ships with, chosen by measurement: accuracy on samples, then latency.

The MAC model of :mod:`qtool.quantization.plan.placement` guesses where integer kernels pay off;
whether they do depends on the CPU, onnxruntime's fusions and the shapes. So ``quantize``
builds a few candidates and measures them:

- ``auto``: the placement rules of the config, the ops between its integer kernels chained
  (:mod:`qtool.quantization.plan.chains`);
- ``unchained``: ``auto`` with those ops in float (every integer kernel a float boundary), built when
  ``auto`` chains an op that computes (Add, Mul, Sigmoid, ...): more accurate, usually slower, never less
  than what ``auto`` gave before chains;
- ``integer``: every ``placement: auto`` node an integer kernel (what fast int8 CPUs want);
- ``storage``: every ``auto`` node storage-only (weights stored quantized, float compute);
- ``dynamic``: ``auto`` with every integer MatMul/Gemm quantizing its input at run time
  (``mode: dynamic``), built when such nodes do most of the model's work (transformers);
- ``search``: ``auto`` plus the float activations the sensitivity search chose
  (:mod:`qtool.choice.search`), when ``auto`` misses the target.

For a decoder, ``dynamic`` is always built, and every candidate also decodes greedily through its
own key/value cache (:mod:`qtool.choice.decode`): one that agrees with the float
model less often than ``dynamic`` does counts as missing the target, whatever its SQNR.

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
import time
from dataclasses import replace

import onnx

from qtool.calibration.dataset import Dataset
from qtool.calibration.decode_steps import has_decode_steps, prefills
from qtool.choice.candidates import BuiltCandidates
from qtool.choice.decode import DecodeJudge, decoder_to_score
from qtool.choice.move_costs import priced_moves, storage_candidate
from qtool.choice.ranges import choose_ranges
from qtool.choice.records import (
    DECISIVE_CONFIDENCE,
    TIE,
    CandidateBuilder,
    FloatModel,
    PlacementChoice,
    Samples,
    meets,
)
from qtool.choice.rounded import round_after_miss, round_kept_integer, round_storage
from qtool.choice.search import FLOAT, FLOAT_ACTIVATIONS, MoveKind, sensitivity_search
from qtool.choice.timing import decisively_faster, faster_than_storage, not_faster_note, time_candidates, why_untimed
from qtool.choice.validation import Validator, validate_choice
from qtool.config import QConfig
from qtool.evaluation.scoring import OutputScorer
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.plan.records import QuantPlan
from qtool.quantization.plan.roles import FUSED_KERNELS
from qtool.schemes import CandidateName, NodePlacement
from qtool.system.stages import stage

DYNAMIC_MIN_SHARE = 0.5  # the dynamic candidate is built when weighted MatMul/Gemm do this share of the MACs
SEARCH_COST_FACTOR = 2.0  # the search's time budget: this many times what the candidates cost to measure
# ... and never under this many seconds (a small model's candidates take a fraction of a second: a burst of load on
# the machine would otherwise end its search before the nodes that reach the target, and change what it writes)
SEARCH_MIN_SECONDS = 2.0


def _matmul_heavy(plan: QuantPlan) -> bool:
    """Whether MatMul/Gemm nodes with a constant weight do most of the integer work (a transformer's shape).

    Only then is the ``dynamic`` candidate built: onnxruntime fuses dynamic quantization for them alone.
    """
    work = [(n.macs or 0, n.op_type in ("MatMul", "Gemm") and n.weight is not None) for n in plan.every_node()]
    total = sum(macs for macs, _ in work)
    return total > 0 and sum(macs for macs, matmul in work if matmul) >= DYNAMIC_MIN_SHARE * total


def _movable(plan: QuantPlan, moves: MoveKind = FLOAT_ACTIVATIONS) -> set[str]:
    """The nodes the search may move: only those placed by "auto" (an explicit placement is the user's).

    Float activations only change integer nodes; moving to float changes storage-only nodes and lookups too, and
    the recurrent nodes whose weights are stored. A body's nodes count (tried after those the search measured),
    not a body's the data never ran.
    """
    placements: tuple[NodePlacement, ...] = (
        ("integer",) if moves == FLOAT_ACTIVATIONS else ("integer", "storage", "lookup")
    )
    plans = [plan, *(b.plan for b in plan.every_branch() if b.observed)]
    recurrent = {w.owner for p in plans for w in p.recurrent_weights}
    return (recurrent if moves == FLOAT else set()) | {
        n.name
        for n in (n for p in plans for n in p.nodes)
        if n.placement in placements and (n.scheme.placement == "auto" or n.scheme.rule.startswith("choice:"))
    }


def measure_placements(
    float_model: FloatModel,
    config: QConfig,
    build: CandidateBuilder,
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
    factory = progress or noop_progress
    scorer = float_model.scorer(samples.scored, samples.known, factory("float outputs", len(samples.scored)))
    started = time.perf_counter()
    config, built, choice = _scored_candidates(config, build, float_model, samples, scorer, (threads, factory))
    if settings.target_sqnr_db is not None:
        round_storage(choice, built, build, scorer)
    timed = settings.latency_runs > 0 and len(built.plans) > 1 and bool(scorer.samples)
    if settings.latency_runs > 0 and len(built.plans) <= 1:
        choice.timing_note = "every placement plans the same model, so there is nothing to choose by time"

    def time_all(names: list[CandidateName] | None = None) -> None:  # timed on the first scored sample
        plans = built.plans if names is None else {n: built.plans[n] for n in names}
        time_candidates(choice, float_model, plans, settings.latency_runs, scorer.samples[0][1], factory)

    if timed:
        with stage("timing the candidates"):
            time_all()
    search_plan = _search_plan(choice, built, timed) if settings.target_sqnr_db is not None else None
    validating = samples.validation is not None and len(samples.validation) > 0 and settings.target_sqnr_db is not None
    validator = Validator(choice, built.plans, samples, float_model, (scorer, factory)) if validating else None
    missed: frozenset[CandidateName] = frozenset()
    if search_plan is not None:
        # The search may cost at most SEARCH_COST_FACTOR times what building, scoring and timing the
        # candidates did (and never more than accuracy.search_seconds): it can only refine them.
        measured = time.perf_counter() - started
        budget = min(settings.search_seconds, max(SEARCH_MIN_SECONDS, SEARCH_COST_FACTOR * measured))
        bounded = replace(config, accuracy=replace(settings, search_seconds=budget))
        added = _search(choice, built, bounded, build, (scorer, samples, float_model), progress, search_plan)
        missed = _missed_before_timing(choice, validator) if added else frozenset()
        if added and not missed and timed and choice.fp32_ms is not None and _may_win(choice, "search"):
            # time the new candidate with fp32 and every candidate that can be kept: the decision compares
            # those on paired rounds; the others keep their first measurement
            time_all([c.name for c in choice.candidates if c.name == "search" or c.meets_target])
    _decide(choice, missed)
    _made(choice, validator, built, build, scorer)
    return built.configs[choice.chosen], choice


def _made(
    choice: PlacementChoice,
    validator: Validator | None,
    built: BuiltCandidates,
    build: CandidateBuilder,
    scorer: OutputScorer,
) -> None:
    """The choice validated (when samples were held out), then settled: each candidate's speed-up, the kept one."""
    if validator is not None:
        validate_choice(choice, validator, redecide=lambda more: _decide(choice, more))
        round_after_miss(choice, built, build, scorer, validator)
    round_kept_integer(choice, built, build, scorer, validator)
    if validator is not None:
        validator.release()
    scorer.release()
    choice.settle()


def _scored_candidates(
    config: QConfig,
    build: CandidateBuilder,
    float_model: FloatModel,
    samples: Samples,
    scorer: OutputScorer,
    run: tuple[int | None, ProgressFactory],
) -> tuple[QConfig, BuiltCandidates, PlacementChoice]:
    """The activation range rule, then every candidate built and scored (a decoder's decoded too)."""
    threads, factory = run
    target = config.accuracy.target_sqnr_db
    decoder = decoder_to_score(float_model.prepared)
    built = BuiltCandidates()
    with stage("activation ranges (the all-integer placement, clipped and min/max)"):
        ranged = choose_ranges(config, build, scorer) if decoder is None else None
    config, range_scores = (ranged.config, ranged.scores) if ranged is not None else (config, {})
    if ranged is not None:
        built.prebuilt["integer"] = ranged.integer  # the winner's all-integer model is not built twice
    with stage("candidate placements (build and score)"):
        _built_candidates(built, config, build, float_model, (samples.scored, threads))
        built.score(scorer, factory("placements", len(built.plans)))
        built.decode()
    files = samples.scored_files if samples.scored_files is not None else scorer.files
    bar = target if target is not None else -math.inf
    choice = PlacementChoice(bar, files, threads or 1, built.candidates(bar), "auto", "")
    choice.decode_bar, choice.decode_steps = built.bar(), has_decode_steps(scorer.files)
    choice.activation_ranges, choice.range_worst_db = config.activation_ranges, range_scores
    choice.parts = [part.name for part in scorer.parts]
    return config, built, choice


def _built_candidates(
    built: BuiltCandidates,
    config: QConfig,
    build: CandidateBuilder,
    float_model: FloatModel,
    scored: tuple[Dataset, int | None],
) -> BuiltCandidates:
    """auto, integer, storage and (MatMul-heavy models, decoders) dynamic; a decoder's also decode when scored."""
    auto = built.add("auto", config, build)
    # Only an op that computes (QLinearAdd, QLinearSigmoid, ...) rounds anew; a pass-through op chained on its
    # input's scale moves the same values, so "unchained" would plan the same accuracy, a speed at the margin
    if any(n.chained and n.op_type in FUSED_KERNELS and n.scheme.placement == "auto" for n in auto.every_node()):
        built.add("unchained", replace(config, chains=False), build)
    integer = built.add("integer", replace(config, auto_placement="integer"), build)
    built.add("storage", replace(config, auto_placement="storage"), build)
    decoder = decoder_to_score(float_model.prepared)  # (cheap: reads the graph's inputs and outputs)
    if _matmul_heavy(integer) or decoder is not None:
        built.add("dynamic", replace(config, auto_placement="dynamic"), build)
    if decoder is not None:
        dataset, threads = scored
        judge = DecodeJudge(float_model.prepared, float_model.weights, decoder, prefills(dataset), threads)
        built.judge = judge  # each decode loop starts from a prefill
    return built


def _search_plan(choice: PlacementChoice, built: BuiltCandidates, timed: bool) -> tuple[CandidateName, MoveKind] | None:
    """Where the sensitivity search starts and how it moves nodes, or None when it cannot pay off.

    It runs when "auto" misses the target, from the most accurate integer candidate that misses it
    ("auto", or "unchained": auto with its chained ops float) and measured faster than storage-only:
    the nearest to the target of those worth refining. When storage-only reaches the target, the
    search gives float activations to the integer nodes that cost the most (its model runs between
    its start and storage); with none faster than storage it does not run. When even storage-only
    misses it, the weights' rounding is part of the error: the search keeps whole nodes float, from
    the more accurate of that integer candidate and storage (one that is less accurate than storage
    would have to win back its activations' error first: a segmentation YOLO's first convolution
    kept float took storage-only's 22.4 dB to 29.4 held out, where the search from "unchained" stopped at 20.0).
    """
    target = choice.target_sqnr_db
    storage_name = storage_candidate(built)
    if meets(built.scores["auto"], target):
        return None
    storage_meets = storage_name is None or meets(built.scores[storage_name], target)
    untimed = not timed or choice.fp32_ms is None
    starts: list[CandidateName] = [
        name
        for name in ("auto", "unchained")
        if name in built.plans
        and not meets(built.scores[name], target)
        and (untimed or faster_than_storage(choice, storage_name, name))
    ]
    start = max(starts, key=lambda name: built.scores[name], default=None)
    if storage_meets:
        if start is None:
            choice.search_note = not_faster_note(choice, storage_name)
            return None
        return start, FLOAT_ACTIVATIONS
    if storage_name is not None and (start is None or built.scores[storage_name] > built.scores[start]):
        start = storage_name
    return (start or "auto"), FLOAT


def _search(
    choice: PlacementChoice,
    built: BuiltCandidates,
    config: QConfig,
    build: CandidateBuilder,
    scoring: tuple[OutputScorer, Samples, FloatModel],
    progress: ProgressFactory | None,
    plan: tuple[CandidateName, MoveKind],
) -> bool:
    """Run the sensitivity search from the start ``plan`` names; True when it added a "search" candidate.

    ``scoring``: the scorer of the candidates, the samples (the search ranks nodes on ``samples.ranked``) and
    the float model.
    """
    scorer, samples, float_model = scoring
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
        (samples.ranked, float_model.elements),
        progress=progress,
        initial=(start_model, _movable(start_plan, moves), built.scores[start]),
        moves=priced_moves(choice, built, float_model, start, moves),
    )
    if choice.search is not None:
        choice.search.start = start
    if choice.search is None or not choice.search.kept_nodes:
        return False
    built.configs["search"] = searched
    built.plans["search"], built.aliases["search"] = build(searched), []
    built.scores["search"] = choice.search.final_sqnr_db
    built.decode()
    timed = {c.name: {"latency_ms": c.latency_ms} for c in choice.candidates}  # kept until all are timed again
    choice.candidates = [c.model_copy(update=timed.get(c.name)) for c in built.candidates(choice.target_sqnr_db)]
    return True


def _missed_before_timing(choice: PlacementChoice, validator: Validator | None) -> frozenset[CandidateName]:
    """{"search"} when the search's placement misses on the validation samples and another one can be kept.

    When the search's placement and another reach the target on the scored samples, the search's is
    validated before it is timed: missing there, it is never kept (the choice is made again without
    it), so it is not timed. When it is the only one that reaches the target, it is timed as before.
    """
    search = next(c for c in choice.candidates if c.name == "search")
    others = any(c.meets_target for c in choice.candidates if c.name != "search")
    if validator is None or not (search.meets_target and others) or validator("search").meets:
        return frozenset()
    return frozenset({"search"})


def _may_win(choice: PlacementChoice, name: str) -> bool:
    """Whether candidate ``name`` could be kept: it reaches the target, or none does and it is the most accurate."""
    candidate = next(c for c in choice.candidates if c.name == name)
    if candidate.meets_target:
        return True
    return not any(c.meets_target for c in choice.candidates) and candidate.sqnr_db >= max(
        c.sqnr_db for c in choice.candidates
    )


def _decide(choice: PlacementChoice, missed: frozenset[CandidateName] = frozenset()) -> bool:
    """Set ``chosen`` and ``reason`` from the measurements; False (nothing set) when ``missed`` leaves none.

    ``missed``: candidates that reached the target on the scored samples but missed it on the
    validation samples: the decision is made again without them, by the same rule.
    """
    candidates = choice.candidates
    meeting = [c for c in candidates if c.meets_target and c.name not in missed]
    if missed and not meeting:
        return False
    # a candidate that could not win is not always timed (see _may_win): only the reaching ones must be
    timed = all(c.latency_ms is not None and c.name in choice.times for c in meeting)
    target = f"{choice.target_sqnr_db:g} dB"
    if not meeting:
        bar = choice.decode_bar
        decoding = [c for c in candidates if bar is None or (c.decode_agreement or 0.0) >= bar] or candidates
        best = max(decoding, key=lambda c: (c.sqnr_db, -candidates.index(c)))
        choice.chosen = best.name
        choice.reason = f"no placement reaches {target} on the scored samples: the most accurate is kept" + (
            " (of those that decode as well as dynamic int8)" if bar is not None else ""
        )
    elif not timed:
        preference = ["search", "auto", "unchained", "integer", "dynamic", "storage"]
        choice.chosen = min(meeting, key=lambda c: preference.index(c.name)).name
        choice.reason = f"reaches {target} (not timed: {why_untimed(choice, meeting)})"
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
            others = (
                f"the only placement {'left ' if missed else ''}that reaches"  # others missed on validation
                if len(meeting) == 1
                else f"the most accurate of {len(meeting)} placements that reach"
            )
            choice.reason = f"{others} {target}" + (
                f"; none measured more than {TIE:.0%} faster" if len(meeting) > 1 else ""
            )
        else:
            choice.reason = (
                f"reaches {target} and measured more than {TIE:.0%} faster than the more accurate placements"
                f" ({DECISIVE_CONFIDENCE:.0%} interval over {len(choice.times[best.name])} interleaved rounds)"
            )
    return True
