"""Accuracy metrics and interleaved latency timing of a reference and a candidate model."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Dataset, Feed
from qtool.calibration.outputs import FloatOutputs
from qtool.errors import QtoolError
from qtool.evaluation.confidence import ratio_db
from qtool.evaluation.intervals import median_interval
from qtool.evaluation.output_kinds import OutputKind, OutputSource, decide_kind, task_note
from qtool.evaluation.providers import GPU_PROVIDERS
from qtool.evaluation.timing import Rounds, time_interleaved
from qtool.graph.session import run_session


@dataclass(frozen=True)
class ErrorMetrics:
    """How far a candidate tensor is from the reference tensor."""

    name: str
    mse: float
    sqnr_db: float  # +inf when the candidate matches exactly
    cosine: float
    max_abs_error: float
    elements: int


_CHUNK = 1 << 16  # elements per float32 partial sum (relative error of a sum well below 1e-5)


@dataclass
class ErrorAccumulator:
    """Streaming sums for the metrics, so no output is kept across samples."""

    sum_ref_sq: float = 0.0
    sum_cand_sq: float = 0.0
    sum_dot: float = 0.0
    sum_err_sq: float = 0.0
    max_abs: float = 0.0
    count: int = 0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        """Add one pair of equally shaped arrays.

        The sums run over float32 chunks (no float64 copy of a whole tensor): each chunk's dot
        products stay short enough for float32, and the chunk sums add up in float64.
        """
        r = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)
        c = np.ascontiguousarray(cand, dtype=np.float32).reshape(-1)
        err = np.empty(min(r.size, _CHUNK), np.float32)
        for start in range(0, r.size, _CHUNK):
            rs, cs = r[start : start + _CHUNK], c[start : start + _CHUNK]
            e = np.subtract(rs, cs, out=err[: rs.size])
            sums = (float(np.dot(rs, rs)), float(np.dot(cs, cs)), float(np.dot(rs, cs)), float(np.dot(e, e)))
            if not all(map(math.isfinite, sums)):  # past float32's range (outputs of 1e20 and more): in float64
                r64, c64 = rs.astype(np.float64), cs.astype(np.float64)
                e = r64 - c64
                sums = (float(np.dot(r64, r64)), float(np.dot(c64, c64)), float(np.dot(r64, c64)), float(np.dot(e, e)))
            self.sum_ref_sq += sums[0]
            self.sum_cand_sq += sums[1]
            self.sum_dot += sums[2]
            self.sum_err_sq += sums[3]
            self.max_abs = max(self.max_abs, float(np.abs(e, out=e).max()))
        self.count += r.size

    def merge(self, other: ErrorAccumulator) -> None:
        self.sum_ref_sq += other.sum_ref_sq
        self.sum_cand_sq += other.sum_cand_sq
        self.sum_dot += other.sum_dot
        self.sum_err_sq += other.sum_err_sq
        self.max_abs = max(self.max_abs, other.max_abs)
        self.count += other.count

    def metrics(self, name: str) -> ErrorMetrics:
        mse = self.sum_err_sq / self.count if self.count else 0.0
        if self.sum_err_sq == 0.0:
            sqnr = math.inf
        elif self.sum_ref_sq == 0.0:
            sqnr = -math.inf
        else:
            sqnr = ratio_db(self.sum_ref_sq, self.sum_err_sq)
        norms = math.sqrt(self.sum_ref_sq) * math.sqrt(self.sum_cand_sq)
        if norms > 0:
            cosine = self.sum_dot / norms
        else:
            cosine = 1.0 if self.sum_ref_sq == self.sum_cand_sq else 0.0
        return ErrorMetrics(name, mse, sqnr, cosine, self.max_abs, self.count)


def is_float(value: object) -> bool:
    """Whether an onnxruntime output is a float tensor (not an integer tensor, a sequence or a map)."""
    return isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)


@dataclass(frozen=True)
class Agreement:
    """How often the candidate picks the reference's class (classification outputs)."""

    name: str
    top1: float  # fraction of rows whose argmax matches the reference's
    top5: float  # fraction of rows whose reference argmax is in the candidate's top 5
    rows: int


@dataclass
class _AgreementCounter:
    top1: int = 0
    top5: int = 0
    rows: int = 0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        ref2, cand2 = ref.reshape(-1, ref.shape[-1]), cand.reshape(-1, cand.shape[-1])
        truth = ref2.argmax(axis=1)
        k = min(5, cand2.shape[1])
        top = np.argpartition(-cand2, k - 1, axis=1)[:, :k]
        self.top1 += int((cand2.argmax(axis=1) == truth).sum())
        self.top5 += int((top == truth[:, None]).any(axis=1).sum())
        self.rows += len(truth)

    def result(self, name: str) -> Agreement:
        rows = max(self.rows, 1)
        return Agreement(name, self.top1 / rows, self.top5 / rows, self.rows)


def box_iou(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """IoU of each pair of ``(x1, y1, x2, y2)`` boxes (last axis 4); a candidate box turned inside out is empty."""
    ref, cand = reference.reshape(-1, 4).astype(np.float64), candidate.reshape(-1, 4).astype(np.float64)
    width = np.clip(np.minimum(ref[:, 2], cand[:, 2]) - np.maximum(ref[:, 0], cand[:, 0]), 0, None)
    height = np.clip(np.minimum(ref[:, 3], cand[:, 3]) - np.maximum(ref[:, 1], cand[:, 1]), 0, None)
    intersection = width * height
    union = _area(ref) + _area(cand) - intersection
    return np.divide(intersection, union, out=np.zeros_like(union), where=union > 0)


def _area(boxes: np.ndarray) -> np.ndarray:
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)


@dataclass(frozen=True)
class BoxIoU:
    """How well the candidate's boxes overlap the reference's (box outputs)."""

    name: str
    mean_iou: float  # over the reference boxes with a positive area
    boxes: int  # how many; empty reference boxes (padding) have no IoU and are left out


@dataclass
class _IouCounter:
    total: float = 0.0
    boxes: int = 0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        ref2 = ref.reshape(-1, 4)
        kept = _area(ref2.astype(np.float64)) > 0
        self.total += float(box_iou(ref2[kept], cand.reshape(-1, 4)[kept]).sum())
        self.boxes += int(kept.sum())

    def result(self, name: str) -> BoxIoU:
        return BoxIoU(name, self.total / max(self.boxes, 1), self.boxes)


TASKS = ("auto", "classification", "none")


@dataclass(frozen=True)
class OutputComparison:
    """Accuracy of the candidate's outputs against the reference's."""

    outputs: list[ErrorMetrics]
    overall: ErrorMetrics
    samples: int
    agreement: list[Agreement]
    task: str  # "classification" or "none"
    task_note: str  # how each output was judged, for the report
    kinds: list[OutputKind] = field(default_factory=list)  # one per float output, in graph order
    boxes: list[BoxIoU] = field(default_factory=list)
    judged: ErrorMetrics | None = None  # the judged outputs pooled, when not every output is judged


def _same_shape(name: str, reference: np.ndarray, candidate: np.ndarray, path: object) -> tuple[np.ndarray, np.ndarray]:
    """The two values of one output as arrays, refused when their shapes differ."""
    if np.shape(reference) != np.shape(candidate):
        raise QtoolError(
            f"output '{name}' has shape {list(np.shape(reference))} in the reference but "
            f"{list(np.shape(candidate))} in the candidate (sample {path})",
            hint="compare a quantized model with the float model it came from",
        )
    return np.asarray(reference), np.asarray(candidate)


def _count_kind(
    kind: str,
    name: str,
    values: tuple[np.ndarray, np.ndarray],
    agreements: dict[str, _AgreementCounter],
    ious: dict[str, _IouCounter],
) -> None:
    """Count one sample of an output toward its kind's figure: top-k agreement of class scores, IoU of boxes."""
    ref, cand = values
    if kind == "class_scores" and ref.ndim >= 1 and ref.shape[-1] >= 2:
        agreements.setdefault(name, _AgreementCounter()).add(ref, cand)
    elif kind == "boxes" and ref.ndim >= 1 and ref.shape[-1] == 4:
        ious.setdefault(name, _IouCounter()).add(ref, cand)


def output_metrics(
    reference: ort.InferenceSession,
    candidate: ort.InferenceSession,
    dataset: Dataset,
    sources: Mapping[str, OutputSource],
    on_progress: Callable[[int], None] | None = None,
    task: str = "auto",
    known: FloatOutputs | None = None,
    judged: frozenset[str] | None = None,
) -> OutputComparison:
    """Run both sessions on every sample and compare their float outputs.

    Every float output gets error metrics. Each is judged on the first sample (see
    :mod:`qtool.evaluation.output_kinds`): class scores also get top-1/top-5 agreement, corner boxes
    also get mean IoU. ``sources`` (from :func:`~qtool.evaluation.output_kinds.output_sources` of
    the reference model) says which op computes each output; ``task`` "classification" makes every
    output with two or more columns class scores, "none" makes none. The reference's outputs of
    samples in ``known`` (kept by calibration) are taken from there instead of running it again.
    ``judged``: the outputs gates judge, when not all of them: their errors are also pooled on their own.
    """
    names = [o.name for o in reference.get_outputs()]
    # an output the candidate stores otherwise (a decoder's int8 key/value cache) is judged by what reads it
    candidate_names = {o.name for o in candidate.get_outputs() if o.type.startswith(("tensor(float", "tensor(bfloat"))}
    names = [n for n in names if n in candidate_names]
    per_output = {name: ErrorAccumulator() for name in names}
    kinds: dict[str, OutputKind] = {}
    agreements: dict[str, _AgreementCounter] = {}
    ious: dict[str, _IouCounter] = {}
    samples = 0
    for path, feed in dataset.samples():
        ref_values = (known.get(path, names) if known is not None else None) or run_session(
            reference, names, feed, f"the reference model on {path}"
        )
        cand_values = run_session(candidate, names, feed, f"the candidate model on {path}")
        for name, r, c in zip(names, ref_values, cand_values, strict=True):
            if not is_float(r):
                continue
            ref, cand = _same_shape(name, r, c, path)
            per_output[name].add(ref, cand)
            if name not in kinds:
                kinds[name] = decide_kind(sources.get(name, OutputSource(name, None)), ref, task)
            _count_kind(kinds[name].kind, name, (ref, cand), agreements, ious)
        samples += 1
        if on_progress:
            on_progress(1)
    overall, pooled = _pooled(per_output, judged)
    metrics = [acc.metrics(name) for name, acc in per_output.items() if acc.count]
    agreement = [counter.result(name) for name, counter in agreements.items() if counter.rows]
    kinds_listed = [kinds[name] for name in names if name in kinds]
    return OutputComparison(
        metrics,
        overall.metrics("overall"),
        samples,
        agreement,
        "classification" if agreement else "none",
        task_note(kinds_listed),
        kinds_listed,
        [counter.result(name) for name, counter in ious.items() if counter.boxes],
        pooled,
    )


def _pooled(
    per_output: dict[str, ErrorAccumulator], judged: frozenset[str] | None
) -> tuple[ErrorAccumulator, ErrorMetrics | None]:
    """Every output's errors pooled, and the judged outputs' (None when every output is judged)."""
    overall, pooled = ErrorAccumulator(), ErrorAccumulator()
    for name, acc in per_output.items():
        overall.merge(acc)
        if judged is not None and name in judged:
            pooled.merge(acc)
    return overall, pooled.metrics("judged") if judged is not None and pooled.count else None


@dataclass(frozen=True)
class LatencyStats:
    """Latency of one model in milliseconds."""

    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    runs: int

    @classmethod
    def from_seconds(cls, seconds: list[float]) -> LatencyStats:
        ms = np.asarray(seconds) * 1e3
        return cls(
            float(np.median(ms)),
            float(np.percentile(ms, 90)),
            float(np.percentile(ms, 99)),
            float(ms.mean()),
            len(seconds),
        )


@dataclass(frozen=True)
class LatencyComparison:
    """Interleaved latency of reference and candidate on one execution provider."""

    provider: str
    threads: int | None
    reference: LatencyStats
    candidate: LatencyStats
    # session creation + first run (TensorRT builds its engines then), reference and candidate; None: not timed
    setup_ms: tuple[float, float] | None = None
    io_binding: bool = False  # inputs and outputs bound on the device (GPU providers): no host copies timed
    # the candidate run on this provider against the float reference (on CPU): worst output SQNR over
    # the evaluation samples; None on the CPU, whose accuracy is the report's main table
    candidate_sqnr_db: float | None = None
    # candidate/reference time, the median over rounds of each round's own ratio (both models ran in it),
    # and its distribution-free interval (see qtool.evaluation.intervals); None: not enough rounds
    ratio: float | None = None
    ratio_interval: tuple[float, float] | None = None
    speedup: float = field(init=False)

    def __post_init__(self) -> None:
        if self.ratio is not None and self.ratio > 0:
            speedup = 1 / self.ratio
        else:
            speedup = self.reference.median_ms / self.candidate.median_ms if self.candidate.median_ms else math.inf
        object.__setattr__(self, "speedup", speedup)

    @property
    def latency_ratio(self) -> float:
        """Candidate time over reference time (the paired median where measured)."""
        if self.ratio is not None:
            return self.ratio
        return self.candidate.median_ms / self.reference.median_ms if self.reference.median_ms else math.inf

    @property
    def speedup_interval(self) -> tuple[float, float] | None:
        """The interval of the speed-up (reference over candidate time)."""
        if self.ratio_interval is None or min(self.ratio_interval) <= 0:
            return None
        return 1 / self.ratio_interval[1], 1 / self.ratio_interval[0]


def paired_ratio(
    reference: Sequence[float], candidate: Sequence[float]
) -> tuple[float | None, tuple[float, float] | None]:
    """Median of the per-round ratios candidate/reference, and its confidence interval."""
    ratios = [c / r for r, c in zip(reference, candidate, strict=True) if r > 0]
    if not ratios:
        return None, None
    return float(np.median(ratios)), median_interval(ratios)


LATENCY_BLOCK_SECONDS = 0.005  # each timed sample: back-to-back runs lasting about this long, averaged


@dataclass(frozen=True)
class LatencyRun:
    """How one latency comparison runs and what it reports beside the times."""

    runs: int  # timed rounds
    warmup: int  # untimed runs of each model first
    threads: int | None  # the sessions' intra-op threads (reported)
    provider: str = "CPUExecutionProvider"
    setup_ms: tuple[float, float] | None = None  # session creation and first run of each model (reported)


def measure_latency(
    reference: ort.InferenceSession,
    candidate: ort.InferenceSession,
    feed: Feed,
    run: LatencyRun,
    on_progress: Callable[[int], None] | None = None,
) -> LatencyComparison:
    """Time both sessions on ``feed``: warm-up runs, then ``run.runs`` timed rounds interleaved.

    Interleaving (see :func:`qtool.evaluation.timing.time_interleaved`) makes machine noise
    (frequency changes, other processes) hit both models alike. On a GPU provider the inputs and
    outputs are bound on the device, so the time is the model's, not the host copies'.
    """
    device = "cuda" if run.provider in GPU_PROVIDERS else None
    times, bound = time_interleaved(
        {"the reference model": reference, "the candidate model": candidate},
        feed,
        Rounds(run.runs, minimum=run.runs, warmup=run.warmup, block_seconds=LATENCY_BLOCK_SECONDS),
        on_round=on_progress,
        device=device,
    )
    ref_times, cand_times = times["the reference model"], times["the candidate model"]
    ratio, interval = paired_ratio(ref_times, cand_times)
    return LatencyComparison(
        run.provider,
        run.threads,
        LatencyStats.from_seconds(ref_times),
        LatencyStats.from_seconds(cand_times),
        run.setup_ms,
        bound,
        ratio=ratio,
        ratio_interval=interval,
    )
