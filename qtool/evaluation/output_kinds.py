"""What each model output holds - class scores, boxes or other values - from the graph and the data.

Top-1 agreement only means something where the last axis of an output holds one score per class;
on a quality score or a box it compares the argmax of three MOS values or four coordinates, a
number that looks like accuracy and is not. So ``compare`` decides per output, from the op that
computes it (looking through reshapes, GlobalAveragePool and a constant bias), its name and the
reference's values on the first sample, and says why. The first rule that applies decides:

1. a Softmax or LogSoftmax computes it: **class scores** when its rows over the last axis are
   normalised (else the softmax ran over another axis, and it holds values);
2. its rows are probabilities (non-negative, summing to 1), whatever computes them: class scores;
3. its last axis is 4 and its name says boxes (box, bbox, loc): **boxes**, compared by IoU as
   well, when the reference's rows are ``(x1, y1, x2, y2)`` corners; otherwise (encoded offsets,
   centre and size) values;
4. its name says regression (quality, landmark, embedding, offset, ...): values;
5. it is ``[N, C]`` logits of a Gemm, MatMul or Conv head with ``C >= MIN_LOGITS``: class scores;
6. its name says class scores (logits, prob, class, cls, score) and it is ``[N, C]`` or
   ``[N, T, C]``: class scores;
7. anything else, and every output with a single column: **values**, error metrics only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.calibration.decoder import model_decoder
from qtool.errors import QtoolError
from qtool.evaluation.output_parts import ConcatLayout, concat_layouts
from qtool.evaluation.row_matching import selection_ordered
from qtool.graph.index import GraphView
from qtool.schemas.reports.compare import OutputKind

# Head ops with fewer outputs than this are taken for regression, not logits. Regression heads are
# small (1 score, 3 MOS scores, 4 box coordinates, 6-8 for poses, quadrilaterals and 3-D boxes),
# while the smallest label sets in common use (MNIST, CIFAR-10) have 10 classes. Small classifiers
# are still found by a Softmax, probabilities in the data or their name.
MIN_LOGITS = 10

HEAD_OPS = frozenset({"Gemm", "MatMul", "Conv"})
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
# Ops that move, relabel or (GlobalAveragePool: per channel) average values, so a head's class axis survives.
PASS_THROUGH_OPS = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "GlobalAveragePool"}
)

_CLASS_WORDS = ("logit", "prob", "class", "cls", "score", "softmax")
_BOX_WORDS = ("box", "bbox", "loc")
# Words that mark a regression output even when a class word is also present ("quality_score").
_REGRESSION_PREFIXES = ("regress", "quality", "landmark", "keypoint", "embed", "feat", "coord", "offset", "delta")
_REGRESSION_TOKENS = frozenset({"reg", "mos", "lmk", "kpt", "kpts", "emb", "pose", "depth", "age"})
_PROBABILITY_TOLERANCE = 1e-2  # on each row's sum; float16 references sum 1000 classes to within ~1e-3


@dataclass(frozen=True)
class OutputSource:
    """What the graph says about one output: the op that computes it (reshapes and a bias looked through)."""

    name: str
    op_type: str | None  # None for a graph input or an initializer passed straight out
    next_token: bool = False  # the logits of a decoder with a key/value cache (see qtool.calibration.decoder)
    ordered_by: str | None = None  # the TopK / NonMaxSuppression whose selection orders its rows (row_matching)
    layouts: tuple[ConcatLayout, ...] = ()  # how Concats join it, the outermost first (output_parts)


def output_sources(model: onnx.ModelProto) -> dict[str, OutputSource]:
    """The op behind each output of the main graph, looking through :data:`PASS_THROUGH_OPS` and a constant bias."""
    graph = model.graph
    view = GraphView(model)
    constants = set(view.every_initializer)
    constants |= {out for node in view.nodes if node.op_type == "Constant" for out in node.output}
    try:
        decoder = model_decoder(model)
    except QtoolError:  # an input numpy cannot feed: not a decoder this module can run
        decoder = None
    logits = decoder.logits if decoder is not None else None
    ordered = selection_ordered(view)
    layouts = concat_layouts(model)
    sources = {}
    for output in graph.output:
        node = view.producer(output.name)
        for _ in range(len(graph.node)):  # bounded: a graph is acyclic
            if node is None:
                break
            if node.op_type in PASS_THROUGH_OPS and node.input:
                upstream = node.input[0]
            elif node.op_type == "Add" and len(node.input) == 2 and (set(node.input) & constants):
                upstream = next((i for i in node.input if i not in constants), node.input[0])
            else:
                break
            node = view.producer(upstream)
        op_type = node.op_type if node is not None else None
        name = output.name
        sources[name] = OutputSource(
            name, op_type, next_token=name == logits, ordered_by=ordered.get(name), layouts=tuple(layouts.get(name, ()))
        )
    return sources


def decide_kind(source: OutputSource, reference: np.ndarray, task: str = "auto") -> OutputKind:
    """How to judge one float output, from its source and the reference's value on one sample.

    ``task`` "classification" makes every output with at least two columns class scores; "none"
    makes none; "auto" applies the rules of this module.
    """
    shape = tuple(int(d) for d in np.shape(reference))
    described = _shape_text(shape)
    if not shape or shape[-1] < 2:
        return OutputKind(output=source.name, kind="values", reason=f"{described}, one value per row")
    if source.next_token and task != "classification":
        return OutputKind(output=source.name, kind="next_token", reason=f"{described} next-token logits of a decoder")
    if task == "classification":
        return OutputKind(output=source.name, kind="class_scores", reason="--task classification")
    kind = _auto_kind(source, np.asarray(reference), shape, described)
    if task == "none" and kind.kind == "class_scores":
        return OutputKind(output=source.name, kind="values", reason=f"{kind.reason}; --task none")
    return kind


def task_note(kinds: list[OutputKind]) -> str:
    """One line for the report: which outputs get classification agreement, which get error metrics only."""
    classified = [k for k in kinds if k.kind == "class_scores"]
    others = [k for k in kinds if k.kind != "class_scores"]
    parts = []
    if classified:
        parts.append("classification: " + ", ".join(f"'{k.output}' ({k.reason})" for k in classified))
    if others:
        parts.append("error metrics only: " + ", ".join(f"'{k.output}' ({k.reason})" for k in others))
    return "; ".join(parts) or "no float output compared"


def _auto_kind(source: OutputSource, reference: np.ndarray, shape: tuple[int, ...], described: str) -> OutputKind:
    name, op = source.name, source.op_type
    tokens = _tokens(name)
    columns = shape[-1]
    if op in SOFTMAX_OPS:
        if _normalised_rows(reference, log=op == "LogSoftmax"):
            return OutputKind(output=name, kind="class_scores", reason=f"{op} output")
        return OutputKind(output=name, kind="values", reason=f"{described}, {op} over another axis")
    if _normalised_rows(reference, log=False):
        return OutputKind(output=name, kind="class_scores", reason=f"{described}, rows are probabilities")
    if columns == 4 and _has_word(tokens, _BOX_WORDS):
        if _corner_boxes(reference):
            return OutputKind(output=name, kind="boxes", reason=f"{described} boxes, IoU")
        return OutputKind(
            output=name, kind="values", reason=f"{described} named like boxes but not (x1, y1, x2, y2) corners"
        )
    if _regression_name(tokens):
        return OutputKind(output=name, kind="values", reason=f"{described}, named like a regression output")
    if op in HEAD_OPS and len(shape) == 2 and columns >= MIN_LOGITS:
        return OutputKind(output=name, kind="class_scores", reason=f"{described} logits from {op}")
    if _has_word(tokens, _CLASS_WORDS) and len(shape) in (2, 3):
        return OutputKind(output=name, kind="class_scores", reason=f"{described}, named like class scores")
    return OutputKind(output=name, kind="values", reason=f"{described}, not class scores")


def _shape_text(shape: tuple[int, ...]) -> str:
    if not shape:
        return "scalar"
    if len(shape) == 1:
        return f"[{shape[0]}]"
    return "[" + ",".join(["N", *(str(d) for d in shape[1:])]) + "]"


def _tokens(name: str) -> list[str]:
    """Lower-case words of a tensor name: ``clsScore:0`` -> ``["cls", "score"]``."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", name)
    return re.findall(r"[a-z]+", spaced.lower())


def _has_word(tokens: list[str], words: tuple[str, ...]) -> bool:
    return any(token.startswith(word) for token in tokens for word in words)


def _regression_name(tokens: list[str]) -> bool:
    return any(t in _REGRESSION_TOKENS or t.startswith(_REGRESSION_PREFIXES) for t in tokens)


def _normalised_rows(reference: np.ndarray, *, log: bool) -> bool:
    """Every row over the last axis is a probability distribution (of log-probabilities with ``log``)."""
    rows = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    if rows.size == 0:
        return False
    if log:
        rows = np.exp(rows)
    elif rows.min() < -_PROBABILITY_TOLERANCE:
        return False
    return bool(np.all(np.abs(rows.sum(axis=1) - 1.0) <= _PROBABILITY_TOLERANCE))


def _corner_boxes(reference: np.ndarray) -> bool:
    """Every row is ``(x1, y1, x2, y2)`` with ``x2 >= x1`` and ``y2 >= y1`` (all-zero padding rows included)."""
    boxes = reference.reshape(-1, 4)
    return bool(len(boxes)) and bool(np.all(boxes[:, 2] >= boxes[:, 0]) and np.all(boxes[:, 3] >= boxes[:, 1]))
