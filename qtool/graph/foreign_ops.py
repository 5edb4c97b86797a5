"""Ops onnxruntime runs in the default domain that onnx has no schema for, hidden from onnx's tools.

onnxruntime's transformer optimizer and model builder write ``SimplifiedLayerNormalization`` in the
default domain. onnx's version converter and checker refuse such nodes; parked in a private domain
they pass through both untouched. onnx's shape inference stops at every contrib op
(``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization``): :func:`infer_through_contrib_ops`
types their outputs from their inputs and infers on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import onnx
from onnx import helper

_PARKED_DOMAIN = "qtool.parked"


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _nodes(sub)


def park_unknown_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Move default-domain nodes onnx has no schema for into :data:`_PARKED_DOMAIN`; returns them."""
    parked = [n for n in _nodes(model.graph) if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)]
    for node in parked:
        node.domain = _PARKED_DOMAIN
    if parked:
        model.opset_import.append(helper.make_opsetid(_PARKED_DOMAIN, 1))
    return parked


def unpark(model: onnx.ModelProto) -> None:
    """Put parked nodes back in the default domain and drop the parking domain's opset."""
    for node in _nodes(model.graph):
        if node.domain == _PARKED_DOMAIN:
            node.domain = ""
    kept = [o for o in model.opset_import if o.domain != _PARKED_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)


# onnxruntime contrib ops whose output types onnx's shape inference cannot give: output index -> the
# input whose type it has (None: float32, as LayerNormalization's mean and inverse deviation are).
_TYPE_RULES: dict[str, dict[int, int | None]] = {
    "SimplifiedLayerNormalization": {0: 0, 1: None, 2: None},
    "SkipSimplifiedLayerNormalization": {0: 0, 1: None, 2: None, 3: 0},
    "SkipLayerNormalization": {0: 0, 1: None, 2: None, 3: 0},
    "GroupQueryAttention": {0: 0, 1: 3, 2: 4, 3: 0},
    "MultiHeadAttention": {0: 0, 1: 6, 2: 7, 3: 0},
    "Attention": {0: 0, 1: 4},
    "RotaryEmbedding": {0: 0},
    "MatMulNBits": {0: 0},
    "FastGelu": {0: 0},
    "BiasGelu": {0: 0},
    "QuickGelu": {0: 0},
    "BiasAdd": {0: 0},
    "GemmFastGelu": {0: 0},
}
_ROUNDS = 64  # contrib ops typed per inference round along a chain; each round follows one more op


def _known_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        elem = value.type.tensor_type.elem_type if value.type.HasField("tensor_type") else 0
        if elem:
            types[value.name] = elem
    return types


def _type_contrib_outputs(model: onnx.ModelProto) -> int:
    """Add value_info types for contrib-op outputs whose inputs' types are known; returns how many."""
    types = _known_types(model)
    added = 0
    for node in model.graph.node:
        rules = _TYPE_RULES.get(node.op_type) if node.domain in ("com.microsoft", "", _PARKED_DOMAIN) else None
        if not rules:
            continue
        for index, source in rules.items():
            if index >= len(node.output) or not node.output[index] or node.output[index] in types:
                continue
            elem: int
            if source is None:
                elem = int(onnx.TensorProto.FLOAT)
            elif source < len(node.input) and node.input[source] in types:
                elem = types[node.input[source]]
            else:
                continue
            model.graph.value_info.append(helper.make_tensor_value_info(node.output[index], elem, None))
            types[node.output[index]] = elem
            added += 1
    return added


def infer_through_contrib_ops(
    model: onnx.ModelProto, infer: Callable[[onnx.ModelProto], onnx.ModelProto]
) -> onnx.ModelProto:
    """``infer`` (onnx's shape inference) repeated past onnxruntime contrib ops, typing their outputs between rounds.

    onnx's inference stops at ops it has no schema for; every tensor after the first
    ``SimplifiedLayerNormalization`` would stay untyped, and nothing could be quantized there.
    """
    inferred = infer(model)
    for _ in range(_ROUNDS):
        if not _type_contrib_outputs(inferred):
            break
        inferred = infer(inferred)
    return inferred
