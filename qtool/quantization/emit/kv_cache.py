"""A decoder's key/value cache stored as int8 inside onnxruntime's GroupQueryAttention, with calibrated scales.

The cache is most of a decoder's memory traffic at long contexts. onnxruntime's ``GroupQueryAttention``
(the contrib form its model builder writes) keeps it as int8 when told how (``k_quant_type`` /
``v_quant_type``, ``kv_cache_bit_width``) and given its scales (``k_scale``, ``v_scale``); nothing
calibrates those. The calibration pass keeps the largest magnitude of every cache per head and head
dimension (:mod:`qtool.calibration.kv_cache_ranges`); :func:`quantize_cache` writes symmetric scales
(``max / 127``) per tensor or per channel (``[kv_heads, 1, head_dim]``, the shape onnxruntime reads) and
turns the cache inputs and outputs int8.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.index import GraphView
from qtool.schemes import CacheGranularity

QUANT_TYPES = {"per_tensor": "PER_TENSOR", "per_channel": "PER_CHANNEL"}
_K_SCALE, _V_SCALE = 12, 13  # GroupQueryAttention's input positions of the cache scales


@dataclass(frozen=True)
class CacheNode:
    """A GroupQueryAttention whose cache is a model input and output (the only kind that can be quantized)."""

    node: str
    past: tuple[str, str]  # key, value inputs
    present: tuple[str, str]  # key, value outputs


def cache_nodes(model: onnx.ModelProto) -> list[CacheNode]:
    """The GroupQueryAttention nodes that read their past from graph inputs and return it as graph outputs."""
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    found = []
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft" or len(node.input) < 5:
            continue
        past, present = (node.input[3], node.input[4]), tuple(node.output[1:3])
        if set(past) <= inputs and len(present) == 2 and set(present) <= outputs:
            found.append(CacheNode(node.name, past, (present[0], present[1])))
    return found


def _scale(largest: np.ndarray, granularity: CacheGranularity) -> np.ndarray:
    """Symmetric int8 scales; a channel that never moved gets the tensor's (or 1) so nothing divides by zero."""
    fallback = float(largest.max()) or 127.0
    if granularity == "per_tensor":
        return np.array([fallback / 127.0], dtype=np.float32)
    safe = np.where(largest > 0, largest, fallback)
    return (safe / 127.0).astype(np.float32)[:, None, :]


def quantize_cache(
    model: onnx.ModelProto, ranges: Mapping[str, np.ndarray], granularity: CacheGranularity
) -> list[str]:
    """Store every :func:`cache_nodes` cache as int8 with scales from ``ranges``; returns the nodes changed."""
    nodes = GraphView(model).by_name
    typed: dict[str, int] = {}
    changed = []
    for found in cache_nodes(model):
        node = nodes[found.node]
        while len(node.input) <= _V_SCALE:
            node.input.append("")
        for position, present in ((_K_SCALE, found.present[0]), (_V_SCALE, found.present[1])):
            name = f"{present}.kv_scale"
            model.graph.initializer.append(numpy_helper.from_array(_scale(ranges[present], granularity), name))
            node.input[position] = name
        kept = [a for a in node.attribute if a.name not in ("k_quant_type", "v_quant_type", "kv_cache_bit_width")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.extend(
            [
                helper.make_attribute("k_quant_type", QUANT_TYPES[granularity]),
                helper.make_attribute("v_quant_type", QUANT_TYPES[granularity]),
                helper.make_attribute("kv_cache_bit_width", 8),
            ]
        )
        typed |= dict.fromkeys((*found.past, *found.present), TensorProto.INT8)
        changed.append(found.node)
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if value.name in typed:
            value.type.tensor_type.elem_type = typed[value.name]
    return changed
