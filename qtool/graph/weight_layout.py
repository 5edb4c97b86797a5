"""Bring weights that exporters hide behind layout ops into the forms qtool quantizes.

Two preparation passes, each returning the nodes it rewrote:

* :func:`fold_weight_layout_ops`: a Transpose, Reshape, Squeeze, Unsqueeze, Flatten or Identity of a
  float initializer (as some exporters write ``MatMul(x, Transpose(W))``) becomes an initializer
  holding the result, so the MatMul/Gemm/Conv reading it sees a constant weight. onnxruntime folds
  these nodes at load anyway; folding them first lets the weight be quantized and stored once.
* :func:`einsums_as_matmuls`: an Einsum of an activation and a constant weight with no index shared
  by both operands and the output (``"bsd,dhk->bshk"``, ``"bshk,hkd->bsd"`` as tf2onnx writes attention
  projections) becomes Transpose/Reshape -> MatMul with the weight flattened to ``[K, N]`` -> Reshape ->
  Transpose. The product is the same; the weight can then be quantized per output column like any
  MatMul weight, and onnxruntime runs its integer MatMul kernels on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.names import fresh_name
from qtool.graph.weights import Weights, is_detached, mark_detached

_LAYOUT_OPS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def fold_weight_layout_ops(graph: onnx.GraphProto, weights: Weights, fixed: set[str]) -> list[str]:
    """Replace layout ops of float initializers with initializers of their result.

    A weight read by that op alone is replaced. A weight other nodes read too (a language model's embedding
    table, tied to its output projection through a Transpose; parameters torch's exporter found equal and
    wrote once, behind an Identity per use) is kept for them: an Identity's readers read the weight itself,
    and another layout op whose result only weighted ops read as their weight gets a copy of its own (else
    the float weight stayed in the file beside the quantized copy, and the model grew). ``fixed``: names that
    must stay as they are (graph inputs and outputs, names subgraphs read).
    """
    inits = {init.name: init for init in graph.initializer}
    folded: list[str] = []
    kept: list[onnx.NodeProto] = []
    readers, weight_reads = _reader_counts(graph), _weight_reads(graph)
    aliases: dict[str, str] = {}
    for node in graph.node:
        source = inits.get(node.input[0]) if node.input else None
        if (
            node.op_type not in _LAYOUT_OPS
            or node.domain not in ("", "ai.onnx")
            or source is None
            or source.data_type != TensorProto.FLOAT
            or source.name in fixed
            or node.output[0] in fixed
        ):
            kept.append(node)
            continue
        shared = readers.get(source.name, 0) != 1
        if shared and node.op_type == "Identity":
            aliases[node.output[0]] = source.name
            folded.append(node.name)
            continue
        if shared and not _own_copy_pays(source, readers.get(node.output[0], 0), weight_reads.get(node.output[0], 0)):
            kept.append(node)
            continue
        result = _layout_result(node, weights.value(source), inits, weights)
        if result is None:
            kept.append(node)
            continue
        new = _add_initializer(graph, weights, node.output[0], result, detached=is_detached(source))
        inits[new.name] = new
        readers[new.name] = readers.pop(node.output[0], 0)
        readers[source.name] -= 1
        folded.append(node.name)
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
        for node in graph.node:
            for index, name in enumerate(node.input):
                node.input[index] = aliases.get(name, name)
    return folded


SHARED_COPY_MIN_VALUES = 4096  # a smaller shared weight is not worth a copy of its own


def _own_copy_pays(source: TensorProto, readers: int, weight_reads: int) -> bool:
    """Whether a shared weight's layout op gets a copy: large, and read only as the weight of weighted ops."""
    return math.prod(source.dims) >= SHARED_COPY_MIN_VALUES and readers > 0 and readers == weight_reads


def _weight_reads(graph: onnx.GraphProto) -> dict[str, int]:
    """How often each name is read as the weight input of a Conv, ConvTranspose, Gemm or MatMul."""
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.input) > 1:
            counts[node.input[1]] = counts.get(node.input[1], 0) + 1
    return counts


def _layout_result(
    node: onnx.NodeProto, values: np.ndarray, inits: dict[str, TensorProto], weights: Weights
) -> np.ndarray | None:
    """The node's output for constant ``values``, or None when its other inputs are not constants."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    extra = [inits.get(name) for name in node.input[1:] if name]
    if any(tensor is None for tensor in extra):
        return None
    constants = [weights.value(tensor) for tensor in extra if tensor is not None]
    try:
        if node.op_type == "Identity":
            return values
        if node.op_type == "Transpose":
            perm = attrs.get("perm")
            return np.ascontiguousarray(np.transpose(values, perm if perm else None))
        if node.op_type == "Flatten":
            axis = int(attrs.get("axis", 1)) % (values.ndim + 1) if values.ndim else 0
            return values.reshape(int(np.prod(values.shape[:axis], dtype=np.int64)), -1)
        if node.op_type == "Reshape":
            if not constants:
                return None
            shape = [int(d) for d in constants[0].reshape(-1)]
            if not attrs.get("allowzero", 0):
                shape = [values.shape[i] if d == 0 and i < values.ndim else d for i, d in enumerate(shape)]
            return values.reshape(shape)
        axes_value = constants[0] if constants else attrs.get("axes")
        axes = [int(a) for a in np.asarray(axes_value).reshape(-1)] if axes_value is not None else None
        if node.op_type == "Squeeze":
            return np.squeeze(values, axis=tuple(axes)) if axes is not None else np.squeeze(values)
        if node.op_type == "Unsqueeze" and axes is not None:
            return np.expand_dims(values, axis=tuple(a % (values.ndim + len(axes)) for a in axes))
    except (ValueError, IndexError, TypeError):
        return None  # a node onnxruntime would reject: leave it for onnxruntime to judge
    return None


def einsums_as_matmuls(graph: onnx.GraphProto, weights: Weights, fixed: set[str]) -> list[str]:
    """Rewrite each Einsum of an activation and a constant weight that is a plain product as a MatMul.

    ``fixed``: names that must stay as they are (see :func:`fold_weight_layout_ops`).
    """
    inits = {init.name: init for init in graph.initializer}
    keep_names = fixed
    readers = _reader_counts(graph)
    taken = _names_in(graph)
    rewritten: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            nodes.append(node)
            continue
        plan = _einsum_plan(node, inits)
        if plan is None or readers.get(plan.weight, 0) != 1 or plan.weight in keep_names:
            nodes.append(node)
            continue
        nodes.extend(plan.build(node, graph, weights, inits[plan.weight], lambda base: fresh_name(base, taken)))
        rewritten.append(node.name)
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


class _EinsumPlan:
    """How one Einsum becomes a MatMul: the operands' index letters and the weight's dims."""

    def __init__(self, activation: str, weight: str, act: str, wgt: str, out: str, dims: dict[str, int]) -> None:
        self.activation, self.weight = activation, weight
        self.batch = [c for c in act if c not in wgt]
        self.contracted = [c for c in wgt if c in act]
        self.columns = [c for c in wgt if c not in act]
        self.act, self.wgt, self.out, self.dims = act, wgt, out, dims

    def build(
        self,
        node: onnx.NodeProto,
        graph: onnx.GraphProto,
        weights: Weights,
        source: TensorProto,
        fresh: Callable[[str], str],
    ) -> list[onnx.NodeProto]:
        base = node.name or node.output[0]
        mk = helper.make_node
        built: list[onnx.NodeProto] = []
        x = self.activation
        order = self.batch + self.contracted
        if list(self.act) != order:
            moved = fresh(f"{base}/input_transposed")
            perm = [self.act.index(c) for c in order]
            built.append(mk("Transpose", [x], [moved], name=fresh(f"{base}/input_transpose"), perm=perm))
            x = moved
        k = math.prod(self.dims[c] for c in self.contracted)
        n = math.prod(self.dims[c] for c in self.columns)
        if len(self.contracted) != 1:
            shape = _add_initializer(graph, weights, fresh(f"{base}/input_shape"), _shape([0] * len(self.batch) + [k]))
            flat = fresh(f"{base}/input_flat")
            built.append(mk("Reshape", [x, shape.name], [flat], name=fresh(f"{base}/input_reshape")))
            x = flat
        # The weight as [K, N]: contracted letters first (in the order the activation now has), then columns.
        values = weights.value(source)
        perm = [self.wgt.index(c) for c in self.contracted + self.columns]
        matrix = np.ascontiguousarray(np.transpose(values, perm)).reshape(k, n)
        weight = _add_initializer(graph, weights, fresh(f"{base}/weight"), matrix, detached=is_detached(source))
        product = fresh(f"{base}/matmul_out")
        # The MatMul keeps the Einsum's name, so node_name rules and reports still find it.
        built.append(mk("MatMul", [x, weight.name], [product], name=node.name or fresh(f"{base}/matmul")))
        y = product
        produced = self.batch + self.columns
        if len(self.columns) != 1:
            dims = [0] * len(self.batch) + [self.dims[c] for c in self.columns]
            shape = _add_initializer(graph, weights, fresh(f"{base}/output_shape"), _shape(dims))
            unflat = fresh(f"{base}/output_unflat")
            built.append(mk("Reshape", [y, shape.name], [unflat], name=fresh(f"{base}/output_reshape")))
            y = unflat
        if produced != list(self.out):
            perm = [produced.index(c) for c in self.out]
            built.append(mk("Transpose", [y], [node.output[0]], name=fresh(f"{base}/output_transpose"), perm=perm))
        else:
            built[-1].output[0] = node.output[0]
        return built


def _einsum_plan(node: onnx.NodeProto, inits: dict[str, TensorProto]) -> _EinsumPlan | None:
    """The MatMul form of ``node``, or None when it is not a product of an activation and a float constant."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    equation = attrs.get("equation")
    if not isinstance(equation, bytes):
        return None
    text = equation.decode().replace(" ", "")
    if "->" not in text or "." in text:
        return None  # implicit outputs and ellipses: left as they are
    lhs, out = text.split("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        return None
    constant = [i for i, name in enumerate(node.input) if name in inits]
    if len(constant) != 1:
        return None
    w_index = constant[0]
    act, wgt = operands[1 - w_index], operands[w_index]
    tensor = inits[node.input[w_index]]
    if tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != len(wgt):
        return None
    if any(len(set(s)) != len(s) for s in (act, wgt, out)):
        return None  # a repeated letter (diagonal, trace)
    shared_out = [c for c in wgt if c in act and c in out]
    summed_away = [c for c in act if c not in wgt and c not in out] + [c for c in wgt if c not in act and c not in out]
    contracted = [c for c in wgt if c in act]
    batch = [c for c in act if c not in wgt]
    if shared_out or summed_away or not contracted or not batch:
        return None
    columns = [c for c in wgt if c not in act]
    if sorted(out) != sorted(batch + columns):
        return None
    dims = dict(zip(wgt, tensor.dims, strict=True))
    return _EinsumPlan(node.input[1 - w_index], node.input[w_index], act, wgt, out, dims)


def _shape(dims: list[int]) -> np.ndarray:
    return np.asarray(dims, dtype=np.int64)


def _add_initializer(
    graph: onnx.GraphProto, weights: Weights, name: str, values: np.ndarray, *, detached: bool = False
) -> TensorProto:
    """Append an initializer (its values in ``weights`` when ``detached``) and return it."""
    tensor = numpy_helper.from_array(values, name)
    if detached:
        mark_detached(tensor)
        weights.arrays[name] = values
    graph.initializer.append(tensor)
    return graph.initializer[-1]


def _reader_counts(graph: onnx.GraphProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def _names_in(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
    return names
