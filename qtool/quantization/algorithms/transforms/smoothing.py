"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights that read them.

Per-tensor uint8 activations spend their grid on the largest channel, so a tensor with a few
outlier channels leaves the others only a handful of levels. For ``Y = X W`` (``X [..., K]``,
``W [K, N]`` constant) the transform divides channel ``k`` of ``X`` by
``s_k = a_k^alpha / w_k^(1 - alpha)`` (``a_k``: the activation's abs max, ``w_k``: the row's abs
max) and multiplies row ``k`` of ``W`` by it: ``Y`` is unchanged in exact arithmetic, the
activation's channels are levelled, and the int8 per-output-channel weight grid, which has
room to spare, takes the difference.

The ``1/s`` costs nothing at run time when the tensor's producer can absorb it: a
LayerNormalization (scale and bias), a MatMul or Gemm (output columns and bias), a Mul by a
constant, or an Add of a constant after one of those. Otherwise a ``Mul(X, 1/s)`` is inserted
in front of the smoothed readers only, so other readers see the original tensor. Conv is not a
fold target: its channels lie on axis 1, never on the last axis a MatMul reduces over.

The transform runs on the float model before calibration; it returns a new model and leaves
the input model, its protos and the values already in the weight store untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.graph.index import GraphView, subgraph_reads
from qtool.graph.names import fresh_name
from qtool.graph.weights import Weights, is_detached, mark_detached
from qtool.quantization.algorithms.transforms.smoothing_records import SmoothedGroup, SmoothingReport
from qtool.quantization.algorithms.transforms.smoothing_scales import (
    DEFAULT_MIN_OUTLIER_RATIO,
    absmax_along,
    along,
    check_alpha,
    outlier_ratio,
    smoothing_scales,
)

log = logging.getLogger(__name__)

_SHAPE_READERS = {"Shape", "Size"}  # read only the shape, which smoothing keeps
_ONNX_DOMAINS = ("", "ai.onnx")


def smooth(
    model: onnx.ModelProto,
    store: Weights,
    act_absmax: dict[str, np.ndarray],
    nodes: Callable[[str], bool] | Collection[str],
    *,
    alpha: float | Callable[[str], float] | None = None,
    min_outlier_ratio: float = DEFAULT_MIN_OUTLIER_RATIO,
    scales: dict[str, tuple[np.ndarray, float]] | None = None,
) -> tuple[onnx.ModelProto, SmoothingReport]:
    """Smooth the activations read by the selected MatMul/Gemm nodes of ``model``.

    Args:
        model: the prepared float model (not changed).
        store: its detached weight values; rescaled detached weights are added under new names.
        act_absmax: per activation tensor (a reader's input A), its per-channel abs max along the
            reduction axis over the calibration data (see :func:`channel_absmax`).
        nodes: the node names that may be smoothed, or a predicate on them.
        alpha: migration strength in [0, 1] (the config's ``smoothquant_alpha``), or a function of the
            node name; a group of readers of one tensor uses the alpha of its first reader in graph order.
            Needed unless ``scales`` are given.
        min_outlier_ratio: smooth only tensors whose :func:`outlier_ratio` reaches this.
        scales: per tensor, the scales ``s`` (and the alpha that chose them) to apply as they are,
            instead of SmoothQuant's (AWQ chooses its own: :func:`.awq.choose_awq_scales`);
            tensors without an entry are left alone.

    Returns:
        The smoothed model and a report of the groups smoothed and the tensors skipped.

    Raises:
        QtoolError: an alpha outside [0, 1], or none without ``scales``.
    """
    if alpha is None and scales is None:
        raise QtoolError("smooth() needs an alpha (SmoothQuant's migration strength) or the scales to apply")
    selected = nodes if callable(nodes) else frozenset(nodes).__contains__
    fixed_alpha = 0.0 if alpha is None else alpha  # with scales given, alpha is never read
    alpha_of = fixed_alpha if callable(fixed_alpha) else (lambda _name: fixed_alpha)
    smoothed = onnx.ModelProto()
    smoothed.CopyFrom(model)
    return _Smoother(smoothed, store, scales).run(act_absmax, selected, alpha_of, min_outlier_ratio)


def _name(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


@dataclass(frozen=True)
class _SmoothedReader:
    """A smoothable reader: ``weight`` (input ``position``) reduces along ``axis`` over the tensor's channels."""

    index: int  # position in graph.node
    position: int
    axis: int


@dataclass(frozen=True)
class _Edit:
    """Divide input ``position`` of node ``index`` by ``s`` along ``axis`` (an axis of size 1 is expanded)."""

    index: int
    position: int
    axis: int


class _Smoother:
    """The transform over one model copy: each group reads the weights as earlier groups left them."""

    def __init__(
        self, model: onnx.ModelProto, store: Weights, fixed: dict[str, tuple[np.ndarray, float]] | None = None
    ) -> None:
        self.model, self.store = model, store
        self.fixed = fixed  # scales chosen elsewhere (AWQ), applied as they are
        self.graph = model.graph
        self.g = GraphView(model)
        self.producer = self.g.producers
        # tensor -> indices of the nodes reading it (each once), bodies included
        self.readers = {name: list(dict.fromkeys(i for i, _ in found)) for name, found in self.g.readers.items()}
        graph = self.graph
        self.taken = {
            *(v.name for v in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]),
            *(n.name for n in graph.node),
            *(name for n in graph.node for name in [*n.input, *n.output]),
            *store.arrays,
        }
        self.inserted: dict[int, list[onnx.NodeProto]] = {}  # node index -> Mul nodes to put before it
        self.replaced: set[str] = set()  # initializers that may no longer be read
        self.created: set[str] = set()

    def run(
        self,
        act_absmax: dict[str, np.ndarray],
        selected: Callable[[str], bool],
        alpha_of: Callable[[str], float],
        min_ratio: float,
    ) -> tuple[onnx.ModelProto, SmoothingReport]:
        readers: dict[str, list[_SmoothedReader]] = {}
        skipped: list[tuple[str, str]] = []
        for index, node in enumerate(self.g.nodes):
            if node.op_type not in ("MatMul", "Gemm") or node.domain not in _ONNX_DOMAINS or not selected(_name(node)):
                continue
            reader = self._reader(index)
            if isinstance(reader, str):
                skipped.append((node.input[0], f"node '{_name(node)}': {reader}"))
            else:
                readers.setdefault(node.input[0], []).append(reader)
        # Producers first: a group's scales then use its readers' weights before a later group's fold.
        order = sorted(readers, key=lambda t: (self.producer.get(t, -1), readers[t][0].index))
        groups: list[SmoothedGroup] = []
        for tensor in order:
            result = self._smooth_tensor(tensor, readers[tensor], act_absmax.get(tensor), alpha_of, min_ratio)
            if isinstance(result, str):
                skipped.append((tensor, result))
            else:
                groups.append(result)
        self._finish()
        return self.model, SmoothingReport(tuple(groups), tuple(skipped))

    def _reader(self, index: int) -> _SmoothedReader | str:
        """Why node ``index`` cannot be smoothed, or its weight's input position and reduction axis."""
        node = self.g.nodes[index]
        if len(node.input) < 2 or node.input[0] == node.input[1]:
            return "it multiplies a tensor by itself"
        weight = self.g.initializers.get(node.input[1])
        if weight is None:
            return "input B is not a constant initializer"
        if weight.data_type != TensorProto.FLOAT:
            return "the weight is not float32"
        if node.op_type == "MatMul":
            if len(weight.dims) < 2:
                return "the weight is a vector"
            return _SmoothedReader(index, 1, len(weight.dims) - 2)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0):
            return "Gemm with transA=1 reduces over the first axis of A, not its channels"
        return _SmoothedReader(index, 1, 1 if attrs.get("transB", 0) else 0)

    def _smooth_tensor(
        self,
        tensor: str,
        readers: list[_SmoothedReader],
        stats: np.ndarray | None,
        alpha_of: Callable[[str], float],
        min_ratio: float,
    ) -> SmoothedGroup | str:
        if stats is None:
            return "no activation statistics"
        if tensor in self.g.initializers:
            return "the activation is a constant"
        if tensor in self.g.elem_types and not self.g.is_float(tensor):
            return "the activation is not float32"
        a = np.asarray(stats, np.float64)
        weights = [self._value(self.g.nodes[r.index].input[r.position]) for r in readers]
        for reader, weight in zip(readers, weights, strict=True):
            if a.ndim != 1 or weight.shape[reader.axis] != a.size:
                node, k = _name(self.g.nodes[reader.index]), weight.shape[reader.axis]
                return f"statistics of shape {a.shape} do not fit node '{node}', which reduces over {k} channels"
        ratio = outlier_ratio(a)
        names = tuple(_name(self.g.nodes[r.index]) for r in readers)
        if self.fixed is not None:
            if tensor not in self.fixed:
                return "no scales chosen for it"
            chosen, alpha = self.fixed[tensor]
            s = np.asarray(chosen, np.float64)
        else:
            if not ratio >= min_ratio:
                return f"outlier ratio max/median {ratio:.2f} is below {min_ratio:g}: no outliers to move"
            alpha = float(alpha_of(names[0]))
            check_alpha(alpha, f"node '{names[0]}'")
            w = np.max([absmax_along(v, r.axis) for r, v in zip(readers, weights, strict=True)], axis=0)
            s = smoothing_scales(a, w, alpha)
        if np.all(s == 1.0):
            return "every channel's scale is 1"
        # Reader weights sharing one initializer get one rescaled copy.
        copies: dict[tuple[str, int], str] = {}
        for reader, weight in zip(readers, weights, strict=True):
            node = self.g.nodes[reader.index]
            key = (node.input[reader.position], reader.axis)
            if key not in copies:
                scaled = weight.astype(np.float64) * along(s, reader.axis, weight.ndim)
                copies[key] = self._write(key[0], scaled.astype(weight.dtype))
            self._rewire(node, reader.position, copies[key])
        chain = self._fold(tensor, s, {r.index for r in readers})
        if not chain:
            self._insert_mul(tensor, s, readers)
        return SmoothedGroup(tensor, names, chain[0] if chain else "", tuple(chain), alpha, ratio)

    def _fold(self, tensor: str, s: np.ndarray, group: set[int]) -> list[str]:
        """Fold ``1/s`` into the tensor's producer chain; the changed nodes, or [] when it cannot."""
        if any(self._value_readers(tensor, exclude=group)):
            return []
        edits = self._fold_edits(tensor, s.size)
        if isinstance(edits, str):
            log.debug("SmoothQuant: %s is not folded: %s", tensor, edits)
            return []
        chain: list[str] = []
        for edit in edits:
            node = self.g.nodes[edit.index]
            value = self._value(node.input[edit.position])
            if value.ndim == 0:
                value = value.reshape(1)
            if value.shape[edit.axis] != s.size:
                value = np.repeat(value, s.size, axis=edit.axis)
            divided = (value.astype(np.float64) / along(s, edit.axis, value.ndim)).astype(value.dtype)
            self._rewire(node, edit.position, self._write(node.input[edit.position], divided))
            if _name(node) not in chain:
                chain.append(_name(node))
        return chain

    def _fold_edits(self, tensor: str, k: int) -> list[_Edit] | str:
        """The constants to divide by ``s`` so that ``tensor`` comes out divided, or why there are none."""
        edits: list[_Edit] = []
        current = tensor
        while True:
            if current in self.g.graph_outputs:
                return f"{current} is a graph output"
            index = self.producer.get(current)
            if index is None:
                return f"{current} is not produced by a node of the main graph"
            node = self.g.nodes[index]
            if node.domain not in _ONNX_DOMAINS:
                return f"its producer '{_name(node)}' is a custom op"
            op = node.op_type
            if op == "LayerNormalization":
                params = [p for p in (1, 2) if p < len(node.input) and node.input[p]]
                if not all(self._last_dim(node.input[p]) == k for p in params):
                    return f"the scale or bias of '{_name(node)}' is not a constant with {k} channels last"
                return [*edits, *(_Edit(index, p, -1) for p in params)]
            if op == "MatMul":
                if self._last_dim(node.input[1]) != k or self.g.rank(node.input[1]) < 2:
                    return f"input B of '{_name(node)}' is not a constant matrix"
                return [*edits, _Edit(index, 1, -1)]
            if op == "Gemm":
                return self._gemm_edits(index, k, edits)
            if op in ("Mul", "Add"):
                const = [p for p in (0, 1) if self._last_dim(node.input[p]) in (1, k)]
                if len(const) != 1:
                    return f"'{_name(node)}' does not combine one activation with one constant"
                edits.append(_Edit(index, const[0], -1))
                if op == "Mul":
                    return edits
                # (y + b) / s = y / s + b / s: y must come out divided too, and nothing else may read it.
                current = node.input[1 - const[0]]
                if any(self._value_readers(current, exclude={index})):
                    return f"{current} has readers besides '{_name(node)}'"
                if self._known_last_dim(current) not in (None, k):
                    return f"{current} is broadcast to {k} channels by '{_name(node)}'"
                continue
            return f"its producer '{_name(node)}' is a {op}, which cannot absorb the scale"

    def _gemm_edits(self, index: int, k: int, edits: list[_Edit]) -> list[_Edit] | str:
        node = self.g.nodes[index]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        b = node.input[1]
        if b not in self.g.initializers or self.g.rank(b) != 2:
            return f"input B of '{_name(node)}' is not a constant matrix"
        axis = 0 if attrs.get("transB", 0) else 1
        if self.g.initializers[b].dims[axis] != k:
            return f"'{_name(node)}' has no {k} output columns"
        edits = [*edits, _Edit(index, 1, axis)]
        if len(node.input) > 2 and node.input[2]:
            if self._last_dim(node.input[2]) not in (1, k):
                return f"input C of '{_name(node)}' is not a constant"
            edits.append(_Edit(index, 2, -1))
        return edits

    def _insert_mul(self, tensor: str, s: np.ndarray, readers: list[_SmoothedReader]) -> None:
        """Put ``Mul(tensor, 1/s)`` before the first reader and point the group at its output."""
        inverse = self._fresh(f"{tensor}/smooth_inverse_scale")
        self.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inverse))
        output = self._fresh(f"{tensor}/smoothed")
        mul = helper.make_node("Mul", [tensor, inverse], [output], name=self._fresh(f"{tensor}/smooth"))
        for value in [*self.graph.input, *self.graph.value_info, *self.graph.output]:
            if value.name == tensor:
                info = self.graph.value_info.add()
                info.CopyFrom(value)
                info.name = output
                break
        for reader in readers:
            self.g.nodes[reader.index].input[0] = output
        self.inserted.setdefault(min(r.index for r in readers), []).append(mul)

    def _finish(self) -> None:
        """Place the inserted nodes and drop the initializers nothing reads any more."""
        if self.inserted:
            nodes = [new for i, node in enumerate(self.g.nodes) for new in [*self.inserted.get(i, []), node]]
            del self.graph.node[:]
            self.graph.node.extend(nodes)
        read = {name for node in self.graph.node for name in _reads(node)} | self.g.graph_outputs
        unused = {name for name in self.replaced if name not in read}
        if unused:
            kept = [t for t in self.graph.initializer if t.name not in unused]
            del self.graph.initializer[:]
            self.graph.initializer.extend(kept)
        for name in unused & self.created:  # intermediate copies this call made, e.g. W folded twice
            self.store.arrays.pop(name, None)

    def _value_readers(self, tensor: str, exclude: set[int]) -> list[int]:
        """The nodes besides ``exclude`` that read ``tensor``'s values (not only its shape)."""
        return [
            i
            for i in self.readers.get(tensor, [])
            if i not in exclude and self.g.nodes[i].op_type not in _SHAPE_READERS
        ]

    def _last_dim(self, name: str) -> int | None:
        """The last dimension of a constant initializer (1 for a scalar), None for anything else."""
        tensor = self.g.initializers.get(name)
        if tensor is None or tensor.data_type != TensorProto.FLOAT:
            return None
        return int(tensor.dims[-1]) if tensor.dims else 1

    def _known_last_dim(self, name: str) -> int | None:
        """The last dimension of an activation when shape inference fixed it."""
        shape = self.g.shapes.get(name)
        return shape[-1] if shape and isinstance(shape[-1], int) and shape[-1] > 0 else None

    def _value(self, name: str) -> np.ndarray:
        return self.store.value(self.g.initializers[name])

    def _write(self, source: str, values: np.ndarray) -> str:
        """A new initializer holding ``values``, detached when ``source`` was; returns its name."""
        name = self._fresh(f"{source}/smoothed")
        values = np.ascontiguousarray(values)
        if is_detached(self.g.initializers[source]):
            tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(values.dtype))
            tensor.dims.extend(values.shape)
            mark_detached(tensor)
            self.store.arrays[name] = values
        else:
            tensor = numpy_helper.from_array(values, name)
        self.graph.initializer.append(tensor)
        self.g.initializers[name] = self.graph.initializer[-1]
        self.created.add(name)
        return name

    def _rewire(self, node: onnx.NodeProto, position: int, name: str) -> None:
        """Point a constant input of ``node`` at ``name``; the old initializer may become unused."""
        self.replaced.add(node.input[position])
        node.input[position] = name

    def _fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)


def _reads(node: onnx.NodeProto) -> list[str]:
    """The tensors ``node`` reads, its bodies' outer-scope reads included."""
    return [name for name in dict.fromkeys([*node.input, *sorted(subgraph_reads(node))]) if name]
