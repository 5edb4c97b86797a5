"""Timing the placement candidates against fp32, interleaved, and telling decisive speed-ups from noise."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import onnx

from qtool.calibration.dataset import Feed
from qtool.choice.records import DECISIVE_CONFIDENCE, TIE, FloatModel, PlacementChoice
from qtool.evaluation.intervals import median_interval
from qtool.evaluation.timing import Rounds, time_interleaved
from qtool.graph.session import create_session
from qtool.progress import ProgressFactory
from qtool.quantization.plan.records import QuantPlan
from qtool.schemas.reports.quantize import PlacementCandidate
from qtool.schemes import CandidateName

TIMING_SECONDS = 3.0  # timing stops after this long once MIN_ROUNDS rounds are done ...
MIN_ROUNDS = 5
# ... unless a comparison the choice depends on is still undecided: then it goes on, up to this many more
# rounds and seconds (a 200 ms model gets 5 rounds in 3 s, too few for a 99 % interval of their median)
EXTRA_ROUNDS = 40
EXTRA_SECONDS = 30.0
TIMING_MAX_BYTES = 1 << 30  # the float model's bytes times the sessions timed together; past it, no timing


def faster_than_storage(choice: PlacementChoice, storage_name: str | None, name: str = "auto") -> bool:
    """Whether candidate ``name`` ran more than :data:`TIE` faster than storage-only, by the median paired ratio.

    The sensitivity search starts only from such a candidate (True when untimed). The median, not a decisive
    interval: the search's own placement is timed in its turn and kept only when decisively faster, so where
    it starts needs no rounds of its own (a ratio near the line held every session for dozens more rounds).
    """
    if storage_name is None or name not in choice.times or storage_name not in choice.times:
        return True
    ratio = median_ratio(choice.times, name, storage_name)
    return ratio is not None and ratio < 1 - TIE


def median_ratio(times: dict[str, list[float]], fast: str, slow: str) -> float | None:
    """The median of the paired per-round ratios ``fast / slow`` (None: no round of both)."""
    ratios = [f / s for f, s in zip(times.get(fast, []), times.get(slow, []), strict=False) if s > 0]
    return statistics.median(ratios) if ratios else None


def not_faster_note(choice: PlacementChoice, storage_name: str | None) -> str:
    """Why no search runs when "auto" is not more than TIE faster than storage-only, true to the table's medians."""
    ratio = median_ratio(choice.times, "auto", storage_name) if storage_name else None
    if ratio is None or ratio >= 1:
        return "no search: the integer kernels measured no faster than storage-only here"
    return (
        f"no search: the integer kernels measured less than {TIE:.0%} faster than storage-only here (auto / "
        f"storage latency {ratio:.2f}, the median of {len(choice.times.get('auto', []))} interleaved rounds)"
    )


def why_untimed(choice: PlacementChoice, meeting: list[PlacementCandidate]) -> str:
    """Why the candidates that reach the target were not all timed, as the run decided it."""
    if choice.timing_note:
        return choice.timing_note
    if choice.fp32_ms is None:
        return "timing is off"
    untimed = [c.name for c in meeting if c.latency_ms is None or c.name not in choice.times]
    return f"{', '.join(untimed)} measured after the timing"


def decisively_faster(times: dict[str, list[float]], fast: str, slow: str) -> bool:
    """Whether ``fast`` beat ``slow`` by more than :data:`TIE`, judged on the paired rounds.

    Rounds are interleaved, so round ``i`` of both met the same machine: the ratio of each pair is
    one sample, and the upper end of the median ratio's :data:`DECISIVE_CONFIDENCE` interval must
    lie below ``1 - TIE``. Too few rounds for that interval: not decisive.
    """
    interval = ratio_interval(times, fast, slow)
    return interval is not None and interval[1] < 1 - TIE


def ratio_interval(times: dict[str, list[float]], fast: str, slow: str) -> tuple[float, float] | None:
    """The :data:`DECISIVE_CONFIDENCE` interval of the median paired ratio ``fast / slow`` (None: too few rounds)."""
    ratios = [f / s for f, s in zip(times.get(fast, []), times.get(slow, []), strict=False) if s > 0]
    return median_interval(ratios, DECISIVE_CONFIDENCE)


def decided(interval: tuple[float, float] | None) -> bool:
    """Whether a ratio's interval lies wholly on one side of the decisive line ``1 - TIE``."""
    return interval is not None and not interval[0] <= 1 - TIE <= interval[1]


def undecided_comparisons(choice: PlacementChoice, names: list[str]) -> Callable[[dict[str, list[float]]], set[str]]:
    """A test of timed rounds: the candidates of the comparisons the choice depends on that are still undecided.

    Those are each candidate reaching the target against every more accurate one that reaches it
    (a faster one displaces it only when decisively faster). A candidate that misses the target is never
    kept for its speed, so its comparisons do not hold timing up (nor does where the search starts: see
    :func:`faster_than_storage`). The names returned (none: all decided) go on
    being timed, with fp32, whose rounds every reported speed-up is paired with.
    """
    listed = {c.name: c for c in choice.candidates if c.name in names}
    ranked = sorted(listed.values(), key=lambda c: -c.sqnr_db)
    pairs = [
        (fast.name, accurate.name)
        for i, accurate in enumerate(ranked)
        for fast in ranked[i + 1 :]
        if accurate.meets_target and fast.meets_target
    ]

    def unsettled(times: dict[str, list[float]]) -> set[str]:
        open_pairs = [(fast, slow) for fast, slow in pairs if not decided(ratio_interval(times, fast, slow))]
        return {"fp32", *(name for pair in open_pairs for name in pair)} if open_pairs else set()

    return unsettled


def time_candidates(
    choice: PlacementChoice,
    float_model: FloatModel,
    plans: dict[CandidateName, tuple[QuantPlan, onnx.ModelProto]],
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
    plan = Rounds(
        rounds,
        seconds=TIMING_SECONDS,
        minimum=min(MIN_ROUNDS, rounds),
        extra_count=EXTRA_ROUNDS,
        extra_seconds=EXTRA_SECONDS,
    )
    unsettled = undecided_comparisons(choice, list(plans))
    times, _ = time_interleaved(sessions, feed, plan, on_round=factory("timing", rounds), unsettled=unsettled)
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

    choice.candidates = [
        c.model_copy(update={"latency_ms": latency(c.name)}) if c.name in times else c for c in choice.candidates
    ]
