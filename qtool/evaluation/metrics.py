"""Accuracy metrics of a candidate model's outputs against its reference (latency: qtool.evaluation.latency)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Dataset
from qtool.calibration.outputs import FloatOutputs
from qtool.errors import QtoolError
from qtool.evaluation.confidence import ratio_db
from qtool.evaluation.output_kinds import OutputSource, decide_kind, task_note
from qtool.evaluation.output_parts import ConcatLayout, OutputPart, scaled_parts
from qtool.evaluation.row_matching import matched_rows
from qtool.graph.session import run_session
from qtool.schemas.reports.compare import Agreement, BoxIoU, Metrics, OutputKind

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

    def metrics(self, name: str) -> Metrics:
        """The error metrics of the sums so far (SQNR +inf: an exact match)."""
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
        return Metrics(name=name, mse=mse, sqnr_db=sqnr, cosine=cosine, max_abs_error=self.max_abs, elements=self.count)


def is_float(value: object) -> bool:
    """Whether an onnxruntime output is a float tensor (not an integer tensor, a sequence or a map)."""
    return isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)


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
        return Agreement(output=name, top1=self.top1 / rows, top5=self.top5 / rows, rows=self.rows)


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
        return BoxIoU(output=name, mean_iou=self.total / max(self.boxes, 1), boxes=self.boxes)


TASKS = ("auto", "classification", "none")


@dataclass(frozen=True)
class OutputComparison:
    """Accuracy of the candidate's outputs against the reference's."""

    outputs: list[Metrics]
    overall: Metrics
    samples: int
    agreement: list[Agreement]
    task: str  # "classification" or "none"
    task_note: str  # how each output was judged, for the report
    kinds: list[OutputKind] = field(default_factory=list)  # one per float output, in graph order
    boxes: list[BoxIoU] = field(default_factory=list)
    judged: Metrics | None = None  # the judged outputs pooled, when not every output is judged
    judged_parts: list[Metrics] = field(default_factory=list)  # the judged outputs' parts (output_parts)


def _same_shape(
    name: str, reference: np.ndarray, candidate: np.ndarray, path: object, *, ordered: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The two values of one output as arrays, refused when their shapes differ.

    ``ordered``: a selection in the graph orders the output's rows: the candidate's are paired with the
    reference's (:func:`~qtool.evaluation.row_matching.matched_rows`).
    """
    if np.shape(reference) != np.shape(candidate):
        raise QtoolError(
            f"output '{name}' has shape {list(np.shape(reference))} in the reference but "
            f"{list(np.shape(candidate))} in the candidate (sample {path})",
            hint="compare a quantized model with the float model it came from",
        )
    ref, cand = np.asarray(reference), np.asarray(candidate)
    return ref, matched_rows(ref, cand) if ordered else cand


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


_FLOAT_TYPES = ("tensor(float", "tensor(bfloat", "tensor(double")  # onnxruntime's names of the types compared


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
    ``judged``: the outputs gates judge, when not all of them: their errors are also pooled on their own. An
    output's parts of different scales (``sources``' layouts) get metrics of their own after it, not pooled again.
    """
    # an output the candidate stores otherwise (a decoder's int8 key/value cache) is judged by what reads it
    candidate_names = {o.name for o in candidate.get_outputs() if o.type.startswith(_FLOAT_TYPES)}
    names = [o.name for o in reference.get_outputs() if o.name in candidate_names]
    errors = _OutputErrors(names, {name: list(source.layouts) for name, source in sources.items()})
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
            ref, cand = _same_shape(name, r, c, path, ordered=name in sources and bool(sources[name].ordered_by))
            errors.add(name, ref, cand)
            if name not in kinds:
                kinds[name] = decide_kind(sources.get(name, OutputSource(name, None)), ref, task)
            _count_kind(kinds[name].kind, name, (ref, cand), agreements, ious)
        samples += 1
        if on_progress:
            on_progress(1)
    overall, pooled = _pooled(errors.per_output, judged)
    agreement = [counter.result(name) for name, counter in agreements.items() if counter.rows]
    kinds_listed = [kinds[name] for name in names if name in kinds]
    return OutputComparison(
        errors.metrics(),
        overall.metrics("overall"),
        samples,
        agreement,
        "classification" if agreement else "none",
        task_note(kinds_listed),
        kinds_listed,
        [counter.result(name) for name, counter in ious.items() if counter.boxes],
        pooled,
        errors.part_metrics(judged),
    )


class _OutputErrors:
    """The errors of each output, and of each part of one that is measured on its own (see output_parts)."""

    def __init__(self, names: list[str], layouts: Mapping[str, list[ConcatLayout]]) -> None:
        self.per_output = {name: ErrorAccumulator() for name in names}
        self.layouts = layouts
        self.parts: dict[str, list[OutputPart]] = {}  # by output, decided on its first sample's value
        self.per_part: dict[str, ErrorAccumulator] = {}

    def add(self, name: str, reference: np.ndarray, candidate: np.ndarray) -> None:
        """One sample of output ``name``, float and quantized."""
        self.per_output[name].add(reference, candidate)
        if name not in self.parts:
            self.parts[name] = scaled_parts({name: self.layouts.get(name, [])}, {name: reference})
            self.per_part.update({part.name: ErrorAccumulator() for part in self.parts[name]})
        for part in self.parts[name]:
            self.per_part[part.name].add(part.of(reference), part.of(candidate))

    def part_metrics(self, judged: frozenset[str] | None) -> list[Metrics]:
        """The metrics of the parts of the outputs ``judged`` (None: every output)."""
        return [
            self.per_part[part.name].metrics(part.name)
            for name, parts in self.parts.items()
            if judged is None or name in judged
            for part in parts
            if self.per_part[part.name].count
        ]

    def metrics(self) -> list[Metrics]:
        """Each output's metrics, each followed by its parts'."""
        listed = []
        for name, acc in self.per_output.items():
            listed.append((name, acc))
            listed += [(part.name, self.per_part[part.name]) for part in self.parts.get(name, [])]
        return [acc.metrics(name) for name, acc in listed if acc.count]


def _pooled(
    per_output: dict[str, ErrorAccumulator], judged: frozenset[str] | None
) -> tuple[ErrorAccumulator, Metrics | None]:
    """Every output's errors pooled, and the judged outputs' (None when every output is judged)."""
    overall, pooled = ErrorAccumulator(), ErrorAccumulator()
    for name, acc in per_output.items():
        overall.merge(acc)
        if judged is not None and name in judged:
            pooled.merge(acc)
    return overall, pooled.metrics("judged") if judged is not None and pooled.count else None
