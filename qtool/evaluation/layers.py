"""Per-layer error: which layer's quantization hurts (the quantization debugger).

Both models run with their intermediate float tensors exposed. Every float tensor computed by
a reference node is paired with the candidate tensor that holds its value, by graph structure
(see :mod:`qtool.evaluation.pairing`: Q/DQ chains, folded BatchNormalization, bias and clamps,
renamed tensors). Each pair gets SQNR and MSE; each candidate node gets the *drop* it introduces:
the SQNR of the worst input it reads minus the SQNR of what it writes, so error that merely flows
through a layer is not blamed on it. A pairing the structure does not confirm gets no drop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from qtool.calibration.dataset import Dataset
from qtool.calibration.statistics import with_exposed_outputs
from qtool.evaluation.metrics import ErrorAccumulator
from qtool.evaluation.pairing import Pairing, measured_tensors, pair_tensors
from qtool.graph.session import create_session, run_session
from qtool.graph.weights import Weights
from qtool.progress import ProgressFactory, noop_progress
from qtool.schemas.reports.compare import SQNR_CAP_DB, Layer, Metrics, capped_db

# at most this many bytes of exposed tensors per sample and session: each group runs both models over the samples,
# so a larger group is fewer runs (a 416x416 detector's search: 3 groups -> 1, its one per-layer pass 1.9 -> 0.8 s,
# peak memory 493 -> 559 MB; onnxruntime's own calibration keeps every exposed tensor of every sample: 502 MB there)
EXPOSED_BYTES = 256 << 20


@dataclass(frozen=True)
class Exposure:
    """What a per-layer pass exposes: which nodes, and how many bytes at once.

    Exposed tensors stay alive until a run ends, so they are measured in groups of at most ``max_bytes``
    per sample (sized from ``elements``, per-sample element counts; an unknown size counts as the largest
    known one): each group runs both models over the samples. ``only``: the candidate nodes to measure
    (with the tensors they read, which their drop is taken from); None: every node.
    """

    elements: dict[str, int] | None = None
    max_bytes: int = EXPOSED_BYTES
    only: frozenset[str] | None = None


def layer_errors(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    dataset: Dataset,
    *,
    threads: int | None = None,
    progress: ProgressFactory | None = None,
    weights: Weights | None = None,
    exposure: Exposure = Exposure(),
) -> list[Layer]:
    """SQNR/MSE of every paired float tensor and the drop its candidate node introduces, worst SQNR first.

    ``weights`` holds the detached values both models use (see :mod:`qtool.graph.weights`); ``exposure``
    what is exposed (every pair, in groups that bound the memory, by default).
    """
    pairing = pair_tensors(reference, candidate)
    against = _measured(pairing, exposure.only)  # candidate tensor -> the reference tensor it holds
    accumulators = {t: ErrorAccumulator() for t in against}
    groups = _groups(against, exposure.elements or {}, exposure.max_bytes)
    advance = (progress or noop_progress)("per-layer", len(dataset) * len(groups))
    for group in groups:
        _measure_group((reference, candidate), dataset, group, against, accumulators, threads, weights, advance)
    measured = {t: acc.metrics(t) for t, acc in accumulators.items() if acc.count}
    return sorted(_rows(pairing, measured), key=lambda r: (capped_db(r.sqnr_db), r.tensor))


def _measured(pairing: Pairing, only: frozenset[str] | None) -> dict[str, str]:
    """The candidate tensors to expose, and the reference tensor each holds, in the pairing's order.

    Every pair's; or ``only`` those nodes' outputs and the tensors they read (their copies, and the float
    tensors those copy).
    """
    every = dict(measured_tensors(pairing))
    if only is None:
        return every
    wanted = set()
    for pair in (p for p in pairing.pairs if p.node in only):
        wanted |= {pair.candidate, *pair.inputs, *(pairing.sources.get(i, i) for i in pair.inputs)}
    return {tensor: source for tensor, source in every.items() if tensor in wanted}


def _rows(pairing: Pairing, measured: dict[str, Metrics]) -> list[Layer]:
    """One row per measured pair: its error, and the drop from the worst input its candidate node reads."""
    graph_inputs = pairing.graph_inputs

    def received(name: str) -> float | None:
        """The capped SQNR of a tensor a node reads; None for weights and constants (they do not count)."""
        if name in measured:
            return capped_db(measured[name].sqnr_db)
        return SQNR_CAP_DB if name in graph_inputs else None

    def worst(values: list[float | None], default: float) -> float:
        return min((v for v in values if v is not None), default=default)

    rows = []
    for position, pair in enumerate(pairing.pairs):
        m = measured.get(pair.candidate)
        if m is None:
            continue
        # The error a node receives: each float input exactly as the candidate feeds it. A node none of
        # whose inputs could be measured is not blamed: its drop counts as 0.
        input_sqnr = worst([received(i) for i in pair.inputs], default=capped_db(m.sqnr_db))
        sources = [pairing.sources.get(i, i) for i in pair.inputs]
        source_sqnr = worst([received(s) for s in sources], default=input_sqnr)
        rows.append(
            Layer(
                tensor=pair.reference,
                node=pair.node,
                op_type=pair.op_type,
                sqnr_db=m.sqnr_db,
                mse=m.mse,
                cosine=m.cosine,
                input_sqnr_db=input_sqnr,
                drop_db=None if pair.uncertain else input_sqnr - capped_db(m.sqnr_db),
                position=position,
                source_sqnr_db=source_sqnr,
                candidate_tensor=pair.candidate,
                paired_by=pair.how,
                folded=list(pair.folded),
                uncertain=pair.uncertain or None,
            )
        )
    return rows


def _groups(against: dict[str, str], elements: dict[str, int], budget: int) -> list[list[str]]:
    """The candidate tensors to expose per pass, in order, each group within ``budget`` bytes."""
    largest = max(elements.values(), default=1 << 20)
    groups: list[list[str]] = [[]]
    used = 0
    for tensor, source in against.items():
        cost = 8 * elements.get(source, largest)  # the candidate's tensor and the reference's
        if groups[-1] and used + cost > budget:
            groups.append([])
            used = 0
        groups[-1].append(tensor)
        used += cost
    return [g for g in groups if g]


def _measure_group(
    models: tuple[onnx.ModelProto, onnx.ModelProto],
    dataset: Dataset,
    group: list[str],
    against: dict[str, str],
    accumulators: dict[str, ErrorAccumulator],
    threads: int | None,
    weights: Weights | None,
    advance: Callable[[int], None],
) -> None:
    """Run both models (reference, candidate) over the samples with ``group`` exposed and add each pair's error."""
    reference, candidate = models
    graph_inputs = {i.name for i in reference.graph.input}
    from_reference = list(dict.fromkeys(against[t] for t in group if against[t] not in graph_inputs))
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    ref_session = create_session(
        with_exposed_outputs(reference, from_reference),
        "the reference model",
        threads=threads,
        level=level,
        weights=weights,
    )
    cand_session = create_session(
        with_exposed_outputs(candidate, group), "the candidate model", threads=threads, level=level, weights=weights
    )
    for path, feed in dataset.samples():
        ref_run = (
            run_session(ref_session, from_reference, feed, f"the reference model on {path}") if from_reference else []
        )
        ref_values = dict(zip(from_reference, ref_run, strict=True))
        cand_values = run_session(cand_session, group, feed, f"the candidate model on {path}")
        for name, c in zip(group, cand_values, strict=True):
            source = against[name]
            r = feed[source] if source in feed else ref_values[source]
            if np.shape(r) == np.shape(c):
                accumulators[name].add(np.asarray(r), np.asarray(c))
        del ref_run, ref_values, cand_values
        advance(1)


def largest_drop(rows: list[Layer]) -> Layer | None:
    """The layer whose quantization introduces the most error (uncertain pairings left out).

    None when no layer loses anything: a node none of whose inputs could be measured (an If whose bodies
    hold the quantized nodes) counts as losing nothing, and is not named as the worst layer for it.
    """
    certain = [(r.drop_db, r) for r in rows if not r.uncertain and r.drop_db is not None]
    best = max(certain, key=lambda pair: (pair[0], -capped_db(pair[1].sqnr_db)), default=None)
    return best[1] if best is not None and best[0] > 0 else None


def layer_op(row: Layer) -> str:
    """The op type as reports show it, with the reference ops the node folds in (``Conv+BatchNormalization``)."""
    return "+".join((row.op_type, *row.folded))


def layer_drop(row: Layer) -> str:
    """The drop as reports show it: dB, or "uncertain" when the pairing is."""
    return "uncertain" if row.uncertain or row.drop_db is None else f"{row.drop_db:.2f}"
