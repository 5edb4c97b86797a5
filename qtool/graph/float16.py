"""float16 models: quantized from their float32 form, with their float16 interface and storage kept.

Every pass of qtool reads float32 tensors (statistics, Q/DQ scales, the weight algorithms).
:func:`upcast_float16` turns a float16 graph into float32 inside (weights widen exactly; casts,
constants and annotated types follow), with a Cast after each float16 input and before each float16
output, so the model still takes and returns float16. :func:`store_float16` then keeps the
weights the quantized model leaves in float at their float16 size: stored as float16, cast back at
load (onnxruntime folds the Cast once when the session starts).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.graph.names import fresh_name
from qtool.graph.weights import Weights, is_detached, mark_detached

FLOAT16, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT
_TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")  # integer attributes naming an element type
STORE_MIN_ELEMENTS = 64  # smaller float weights (norm epsilons, scalars) stay float32: a Cast would cost more


def refuse_bfloat16(model: onnx.ModelProto, source: str) -> None:
    """Raise, before any sample is read, when ``model`` computes in bfloat16 (its inputs or most of its weights).

    qtool quantizes float32 and float16 models, and onnxruntime's CPU provider has no bfloat16 Conv, Gemm or
    most other kernels: samples could not even be given in a type numpy writes (``|V2``).
    """
    inputs = [v.name for v in model.graph.input if v.type.tensor_type.elem_type == TensorProto.BFLOAT16]
    sizes = {kind: 0 for kind in (TensorProto.BFLOAT16, FLOAT, FLOAT16)}
    for init in model.graph.initializer:
        if init.data_type in sizes:
            sizes[init.data_type] += int(np.prod(init.dims))
    if inputs or sizes[TensorProto.BFLOAT16] > sizes[FLOAT] + sizes[FLOAT16]:
        what = f"input '{inputs[0]}' is" if inputs else "its weights are"
        raise QtoolError(
            f"{source}: {what} bfloat16; qtool quantizes float32 and float16 models, and onnxruntime's CPU "
            "provider runs few bfloat16 kernels",
            hint="export the model in float32: for PyTorch, model.float() before torch.onnx.export",
        )


def has_float16(graph: onnx.GraphProto) -> bool:
    """Whether any tensor of ``graph`` (inputs, outputs, weights, annotations, casts) is float16."""
    values = [*graph.input, *graph.output, *graph.value_info]
    if any(v.type.tensor_type.elem_type == FLOAT16 for v in values):
        return True
    if any(init.data_type == FLOAT16 for init in graph.initializer):
        return True
    if any(sparse.values.data_type == FLOAT16 for g in _graphs(graph) for sparse in g.sparse_initializer):
        return True
    return any(_float16_attribute(a) for g in _graphs(graph) for n in g.node for a in n.attribute)


def upcast_float16(graph: onnx.GraphProto, weights: Weights) -> list[str]:
    """Compute ``graph`` in float32 behind a float16 interface; returns the weights that were float16."""
    widened = []
    for sub in _graphs(graph):
        for init in sub.initializer:
            if init.data_type == FLOAT16:
                values = weights.value(init).astype(np.float32)
                init.data_type = FLOAT
                weights.replace(init, values)
                widened.append(init.name)
        for sparse in sub.sparse_initializer:
            if sparse.values.data_type == FLOAT16:
                sparse.values.CopyFrom(_widened(sparse.values))
        for value in [
            *sub.value_info,
            *(sub.input if sub is not graph else []),
            *(sub.output if sub is not graph else []),
        ]:
            _widen_type(value.type)
        for node in sub.node:
            for attribute in node.attribute:
                _widen_attribute(attribute)
    _cast_interface(graph, weights)
    return widened


def store_float16(model: onnx.ModelProto, names: set[str], weights: Weights) -> int:
    """Store the float32 weights in ``names`` (float16 in the source) as float16 again; returns how many."""
    graph = model.graph
    taken = {t for n in graph.node for t in [*n.input, *n.output]} | {i.name for i in graph.initializer}
    taken |= {n.name for n in graph.node}
    kept, casts, stored = [], [], 0
    for init in graph.initializer:
        dims = int(np.prod(init.dims)) if init.dims else 1
        if init.name not in names or init.data_type != FLOAT or dims < STORE_MIN_ELEMENTS:
            kept.append(init)
            continue
        values = weights.value(init).astype(np.float16)
        half = numpy_helper.from_array(values, fresh_name(f"{init.name}/float16", taken))
        if is_detached(init):
            weights.arrays[half.name] = values
            mark_detached(half)
        kept.append(half)
        casts.append(
            helper.make_node("Cast", [half.name], [init.name], fresh_name(f"{init.name}/cast", taken), to=FLOAT)
        )
        stored += 1
    if stored:
        del graph.initializer[:]
        graph.initializer.extend(kept)
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend([*casts, *nodes])
    return stored


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph of its nodes (If, Loop, Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _graphs(sub)


def _float16_attribute(attribute: onnx.AttributeProto) -> bool:
    if attribute.type == onnx.AttributeProto.TENSOR:
        return attribute.t.data_type == FLOAT16
    if attribute.type == onnx.AttributeProto.SPARSE_TENSOR:
        return attribute.sparse_tensor.values.data_type == FLOAT16
    return attribute.type == onnx.AttributeProto.INT and attribute.name in _TYPE_ATTRIBUTES and attribute.i == FLOAT16


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)


def _widen_attribute(attribute: onnx.AttributeProto) -> None:
    """float16 -> float32 in a constant's tensor (dense or sparse: its values) or a type attribute (Cast's ``to``)."""
    if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT16:
        attribute.t.CopyFrom(_widened(attribute.t))
    elif attribute.type == onnx.AttributeProto.SPARSE_TENSOR and attribute.sparse_tensor.values.data_type == FLOAT16:
        attribute.sparse_tensor.values.CopyFrom(_widened(attribute.sparse_tensor.values))
    elif attribute.type == onnx.AttributeProto.INT and attribute.name in _TYPE_ATTRIBUTES and attribute.i == FLOAT16:
        attribute.i = FLOAT


def _widen_type(value_type: onnx.TypeProto) -> None:
    """float16 -> float32 in a tensor type, and inside sequence and optional types."""
    kind = value_type.WhichOneof("value")
    if kind == "tensor_type" and value_type.tensor_type.elem_type == FLOAT16:
        value_type.tensor_type.elem_type = FLOAT
    elif kind == "sequence_type":
        _widen_type(value_type.sequence_type.elem_type)
    elif kind == "optional_type":
        _widen_type(value_type.optional_type.elem_type)


def _cast_interface(graph: onnx.GraphProto, weights: Weights) -> None:
    """A Cast to float32 after each float16 input and back to float16 before each float16 output.

    An output that is a weight (a constant the model returns) is renamed like a node's output.
    """
    taken = _taken(graph)
    inputs = {v.name for v in graph.input if v.type.tensor_type.elem_type == FLOAT16}
    inner = float32_names(graph)
    outputs = set(inner) - inputs
    for name in inner.values():
        taken.add(name)
    annotations = [v for v in graph.value_info if v.name not in inner]  # those names are the interface's again
    del graph.value_info[:]
    graph.value_info.extend(annotations)
    for sub in _graphs(graph):
        for node in sub.node:
            node.input[:] = [inner.get(name, name) for name in node.input]
            if sub is graph:
                node.output[:] = [inner.get(name, name) for name in node.output]
    for init in graph.initializer:
        if init.name in inner:
            if is_detached(init):
                weights.arrays[inner[init.name]] = weights.arrays.pop(init.name)
            init.name = inner[init.name]
    front = [
        helper.make_node("Cast", [n], [inner[n]], fresh_name(f"{n}/to_float32", taken), to=FLOAT)
        for n in sorted(inputs)
    ]
    back = [
        helper.make_node("Cast", [inner[n]], [n], fresh_name(f"{n}/to_float16", taken), to=FLOAT16)
        for n in sorted(outputs)
    ]
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend([*front, *nodes, *back])


def _taken(graph: onnx.GraphProto) -> set[str]:
    taken = {t for n in graph.node for t in [*n.input, *n.output]} | {v.name for v in [*graph.input, *graph.output]}
    return taken | {n.name for n in graph.node} | {i.name for i in graph.initializer}


def float32_names(graph: onnx.GraphProto) -> dict[str, str]:
    """The name :func:`upcast_float16` gives inside to each float16 input and output of ``graph``, by its own name.

    Statistics of a float16 model are of its float32 form: a file written for another tool names
    the model's own tensors, so those names are mapped back through this.
    """
    taken = _taken(graph)
    inputs = {v.name for v in graph.input if v.type.tensor_type.elem_type == FLOAT16}
    outputs = {v.name for v in graph.output if v.type.tensor_type.elem_type == FLOAT16} - inputs
    return {name: fresh_name(f"{name}/float32", taken) for name in sorted(inputs | outputs)}
