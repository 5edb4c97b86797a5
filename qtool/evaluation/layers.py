"""Per-layer error: which layer's quantization hurts (the quantization debugger).

Both models run with their intermediate float tensors exposed. Every float
tensor computed by a reference node is paired with the same-named tensor of the
candidate (qtool's rewrite keeps float tensor names). Each pair gets SQNR and
MSE; each candidate node gets the *drop* it introduces: the SQNR of the worst
input it reads minus the SQNR of what it writes, so error that merely flows
through a layer is not blamed on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from qtool.calibration.dataset import Dataset
from qtool.calibration.statistics import with_exposed_outputs
from qtool.evaluation.metrics import ErrorAccumulator
from qtool.graph.session import create_session, run_session
from qtool.graph.weights import Weights
from qtool.progress import ProgressFactory, noop_progress

SQNR_CAP_DB = 100.0  # an exact match counts as 100 dB when differences are taken


@dataclass(frozen=True)
class LayerError:
    """The error of one tensor, and of the node that writes it in the candidate."""

    tensor: str
    node: str  # the candidate node that computes it (Q/DQ looked through)
    op_type: str
    sqnr_db: float
    mse: float
    cosine: float
    input_sqnr_db: float  # the worst SQNR among the node's float inputs (capped)
    drop_db: float  # input_sqnr_db - sqnr_db (both capped at SQNR_CAP_DB)
    position: int = 0  # order of the tensor in the reference graph
    source_sqnr_db: float = SQNR_CAP_DB  # like input_sqnr_db, but before the node's own input Q/DQ

    @property
    def drop_with_inputs_db(self) -> float:
        """The error the node adds including the quantization of its inputs (what float activations undo)."""
        return self.source_sqnr_db - _capped(self.sqnr_db)


def _capped(value: float) -> float:
    return min(value, SQNR_CAP_DB) if not math.isnan(value) else -SQNR_CAP_DB


def _float_tensors(model: onnx.ModelProto) -> list[str]:
    """Float32 outputs of the main graph's nodes that depend on a graph input (in graph order)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - best effort: without types we pair what the graph declares
        inferred = model
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]
        if v.type.HasField("tensor_type")
    }
    # Only tensors computed from the inputs: weights in Constant nodes (which graph preparation folds
    # BatchNormalization into) and shape arithmetic are not layers.
    dynamic = {i.name for i in model.graph.input}
    names: list[str] = []
    for node in model.graph.node:
        if not any(i in dynamic for i in node.input):
            continue
        dynamic.update(node.output)
        names += [o for o in node.output if o and types.get(o) == TensorProto.FLOAT]
    return list(dict.fromkeys(names))


class _Lineage:
    """Looks through Q/DQ pairs in the candidate to the node that really computes a tensor."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.producer = {o: n for n in model.graph.node for o in n.output}

    def compute_node(self, tensor: str) -> onnx.NodeProto | None:
        """The node that really computes ``tensor`` (DequantizeLinear and QuantizeLinear looked through)."""
        return self.producer.get(self.float_source(tensor))

    def float_source(self, tensor: str) -> str:
        """The float tensor that ``tensor`` is a quantized-and-dequantized copy of (itself if none)."""
        node = self.producer.get(tensor)
        for _ in range(8):
            if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear"):
                return tensor
            tensor = node.input[0]
            node = self.producer.get(tensor)
        return tensor


EXPOSED_BYTES = 256 << 20  # at most this many bytes of exposed tensors per sample and session


def layer_errors(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    dataset: Dataset,
    *,
    threads: int | None = None,
    progress: ProgressFactory | None = None,
    weights: Weights | None = None,
    elements: dict[str, int] | None = None,
    max_exposed_bytes: int = EXPOSED_BYTES,
) -> list[LayerError]:
    """SQNR/MSE of every paired float tensor and the drop its candidate node introduces, worst SQNR first.

    ``weights`` holds the detached values both models use (see :mod:`qtool.graph.weights`).
    Exposed tensors stay alive until a run ends, so they are measured in groups of at most
    ``max_exposed_bytes`` per sample (sized from ``elements``, per-sample element counts; an
    unknown size counts as the largest known one): each group runs both models over the samples.
    """
    candidate_names = {o for n in candidate.graph.node for o in n.output}
    paired = [t for t in _float_tensors(reference) if t in candidate_names]
    graph_inputs = {i.name for i in reference.graph.input}
    # What a quantized graph input (or the output of a float node) really feeds the quantized nodes that
    # read it: the candidate's "x/dequantized" against the reference's "x".
    dequantized_inputs = {
        f"{t}/dequantized": t for t in [*graph_inputs, *paired] if f"{t}/dequantized" in candidate_names
    }
    exposed = [*paired, *dequantized_inputs]
    accumulators = {t: ErrorAccumulator() for t in exposed}
    groups = _groups(paired, dequantized_inputs, graph_inputs, elements or {}, max_exposed_bytes)
    advance = (progress or noop_progress)("per-layer", len(dataset) * len(groups))
    for group in groups:
        _measure_group(
            reference, candidate, dataset, group, dequantized_inputs, accumulators, threads, weights, advance
        )
    measured = {t: acc.metrics(t) for t, acc in accumulators.items() if acc.count}
    metrics = {t: m for t, m in measured.items() if t not in dequantized_inputs}
    lineage = _Lineage(candidate)

    def worst_received(names: list[str], default: float) -> float:
        """The worst capped SQNR among ``names``; weights and constants (neither measured nor inputs) do not count."""
        received = (_capped(measured[i].sqnr_db) if i in measured else SQNR_CAP_DB for i in names)
        return min(
            (s for s, i in zip(received, names, strict=True) if i in measured or i in graph_inputs), default=default
        )

    order = {t: i for i, t in enumerate(paired)}
    rows = []
    for tensor, m in metrics.items():
        node = lineage.compute_node(tensor)
        # The error a node receives: each float input exactly as the candidate feeds it. Inputs that are
        # neither measured nor graph inputs are weights or constants and do not count.
        inputs = list(node.input) if node is not None else []
        # A node none of whose inputs could be measured is not blamed: its drop counts as 0.
        input_sqnr = worst_received(inputs, default=_capped(m.sqnr_db))
        source_sqnr = worst_received([lineage.float_source(i) for i in inputs], default=input_sqnr)
        rows.append(
            LayerError(
                tensor=tensor,
                node=node.name if node is not None else tensor,
                op_type=node.op_type if node is not None else "?",
                sqnr_db=m.sqnr_db,
                mse=m.mse,
                cosine=m.cosine,
                input_sqnr_db=input_sqnr,
                drop_db=input_sqnr - _capped(m.sqnr_db),
                position=order[tensor],
                source_sqnr_db=source_sqnr,
            )
        )
    return sorted(rows, key=lambda r: (_capped(r.sqnr_db), r.tensor))


def _groups(
    paired: list[str],
    dequantized_inputs: dict[str, str],
    graph_inputs: set[str],
    elements: dict[str, int],
    budget: int,
) -> list[list[str]]:
    """The candidate tensors to expose per pass, in graph order, each group within ``budget`` bytes."""
    twins: dict[str, list[str]] = {}
    for name, source in dequantized_inputs.items():
        twins.setdefault(source, []).append(name)
    largest = max(elements.values(), default=1 << 20)
    groups: list[list[str]] = [[name for source in graph_inputs for name in twins.get(source, [])]]
    used = 0
    for tensor in paired:
        cost = 4 * elements.get(tensor, largest) * (1 + len(twins.get(tensor, [])))
        if groups[-1] and used + cost > budget:
            groups.append([])
            used = 0
        groups[-1] += [tensor, *twins.get(tensor, [])]
        used += cost
    return [g for g in groups if g]


def _measure_group(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    dataset: Dataset,
    group: list[str],
    dequantized_inputs: dict[str, str],
    accumulators: dict[str, ErrorAccumulator],
    threads: int | None,
    weights: Weights | None,
    advance: Callable[[int], None],
) -> None:
    """Run both models over the samples with ``group`` exposed and add each pair's error."""
    wanted = list(dict.fromkeys(dequantized_inputs.get(t, t) for t in group))
    graph_inputs = {i.name for i in reference.graph.input}
    from_reference = [t for t in wanted if t not in graph_inputs]
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
            source = dequantized_inputs.get(name, name)
            r = feed[source] if source in feed else ref_values[source]
            if np.shape(r) == np.shape(c):
                accumulators[name].add(np.asarray(r), np.asarray(c))
        del ref_run, ref_values, cand_values
        advance(1)


def largest_drop(rows: list[LayerError]) -> LayerError | None:
    """The layer whose quantization introduces the most error."""
    return max(rows, key=lambda r: (r.drop_db, -_capped(r.sqnr_db)), default=None)
