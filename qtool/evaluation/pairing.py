"""Which candidate tensor holds the value of which reference tensor: pairing by graph structure.

A quantized model is rarely the float graph with Q/DQ pairs added. Quantizers fold
BatchNormalization and bias into the Conv before it, drop a Relu whose clamp the following
uint8 QuantizeLinear already applies, rename tensors (``x_QuantizeLinear_Input``) and give the
dequantized copies of a tensor new names. Pairing by names alone then compares a raw Conv
output with the reference's Relu output, or finds no input error at all.

:func:`pair_tensors` walks the candidate's computing nodes (QuantizeLinear/DequantizeLinear
looked through) in graph order and finds the reference node each one computes: by output name,
by node name, or by op type and the reference tensors its inputs carry. From that node it follows
the reference chain of ops the quantizer may have folded away (BatchNormalization, a Relu or
Clip, Add/Sub/Mul/Div by a constant, Identity, Dropout) as long as the candidate does not compute
that op itself. The candidate's output then pairs with the end of that chain; when a clamp was
folded into the quantization, or the value is a graph output, the dequantized copy is measured
(it is what the rest of the graph sees). A pairing the structure contradicts is kept but marked
uncertain, and reports give no drop for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from qtool.graph.index import GraphView

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
# Ops a quantizer folds into the producer before them (or into the following QuantizeLinear).
FOLDABLE_OPS = ("BatchNormalization", "Relu", "Clip", "Add", "Sub", "Mul", "Div", "Identity", "Dropout")
CLAMPS = ("Relu", "Clip")
AFFINE_OPS = ("Add", "Sub", "Mul", "Div")
# Candidate op types that compute what a reference op of another type did.
EQUIVALENT_OPS = {
    "MatMulNBits": "MatMul",
    "MatMulInteger": "MatMul",
    "FusedMatMul": "MatMul",
    "ConvInteger": "Conv",
    "FusedConv": "Conv",
    "FusedGemm": "Gemm",
}


@dataclass(frozen=True)
class Pair:
    """One reference tensor and the candidate tensor measured against it."""

    reference: str  # the float model's tensor (what the user knows)
    candidate: str  # the candidate tensor holding the same value
    node: str  # the candidate node that computes it (Q/DQ looked through)
    op_type: str
    how: str  # "name", "node name", "structure"
    folded: tuple[str, ...] = ()  # reference ops the candidate node also computes (BatchNormalization, Relu ...)
    uncertain: str = ""  # why the pairing may be wrong ("" when the structure confirms it)
    inputs: tuple[str, ...] = ()  # the candidate node's inputs, as it reads them


@dataclass(frozen=True)
class Pairing:
    """Every pair, in the reference's graph order, and the dequantized copies fed to candidate nodes."""

    pairs: list[Pair]
    fed: dict[str, str]  # candidate tensor read by a computing node (a DQ chain's end) -> reference tensor
    sources: dict[str, str]  # candidate tensor read by a computing node -> the float tensor it is a copy of
    graph_inputs: set[str]
    unpaired: int  # reference float tensors computed from the inputs that no candidate tensor holds


class _Graph(GraphView):
    """The graph view, and the tensors computed from the graph inputs."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        self.dynamic = set(self.graph_inputs)
        for n in self.nodes:
            if any(i in self.dynamic for i in n.input):
                self.dynamic.update(o for o in n.output if o)

    def float_source(self, tensor: str) -> str:
        """The tensor that ``tensor`` is a quantized-and-dequantized copy of (itself if none)."""
        for _ in range(16):
            node = self.producer(tensor)
            if node is None or node.op_type not in QDQ_OPS:
                return tensor
            tensor = node.input[0]
        return tensor

    def holds_integers(self, node: onnx.NodeProto) -> bool:
        """Whether ``node`` reads a stored integer table and writes integers (a quantized lookup's Gather)."""
        if node.op_type != "Gather":
            return False
        table = node.input[0]
        if table in self.initializers:
            return self.initializers[table].data_type not in FLOAT_TYPES
        widen = self.producer(table)
        return (
            widen is not None
            and widen.op_type == "Cast"
            and any(a.name == "to" and a.i not in FLOAT_TYPES for a in widen.attribute)
        )

    def dequantized_copies(self, tensor: str) -> list[str]:
        """The ends of the Q/DQ chains that start at ``tensor`` (what its consumers read instead)."""
        ends, todo = [], [tensor]
        while todo:
            current = todo.pop()
            for c in self.consumers.get(current, []):
                if c.op_type in QDQ_OPS and c.input[0] == current:
                    if c.op_type == "DequantizeLinear":
                        ends.append(c.output[0])
                    todo.append(c.output[0])
        return ends

    def is_quantized(self, tensor: str) -> bool:
        """Whether ``tensor`` holds quantized integers (a DequantizeLinear reads it as its data)."""
        return any(c.op_type == "DequantizeLinear" and c.input[0] == tensor for c in self.consumers.get(tensor, []))

    def reads(self, tensor: str) -> list[onnx.NodeProto]:
        """The computing nodes that read ``tensor`` directly or through Q/DQ chains."""
        found = [c for c in self.consumers.get(tensor, []) if c.op_type not in QDQ_OPS]
        for copy in self.dequantized_copies(tensor):
            found += [c for c in self.consumers.get(copy, []) if c.op_type not in QDQ_OPS]
        return found


def float_tensors(model: onnx.ModelProto) -> list[str]:
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


def pair_tensors(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> Pairing:
    """Pair every reference float tensor computed from the inputs with the candidate tensor holding it."""
    ref, cand = _Graph(reference), _Graph(candidate)
    floats = float_tensors(reference)
    wanted = set(floats)
    carries = {
        name: name for name in cand.graph_inputs if name in ref.graph_inputs
    }  # candidate float tensor -> reference
    pairs: dict[str, Pair] = {}
    for node in cand.nodes:
        if node.op_type in QDQ_OPS or not any(i in cand.dynamic for i in node.input):
            continue
        if cand.holds_integers(node):  # its float value is the Mul that rescales the rows it read
            continue
        inputs = _carried_inputs(node, cand, carries)
        match, how = _reference_node(node, inputs, ref, ref.by_name)
        for index, output in enumerate(node.output):
            if not output:
                continue
            if match is None or index >= len(match.output):
                _pair_by_name(node, output, inputs, ref, wanted, pairs, carries)
                continue
            end, folded = _follow_folded(match.output[index], node, output, ref, cand, carries)
            measured, uncertain = output, ""
            if output in ref.producers and output != end and output in wanted:
                uncertain = f"named like {output} but computes {end}"
            copies = cand.dequantized_copies(output)
            if cand.is_quantized(output) or any(op in CLAMPS for op in folded) or end in ref.graph_outputs:
                if copies:
                    measured = next((c for c in copies if c in cand.graph_outputs), copies[0])
                elif any(op in CLAMPS for op in folded):
                    uncertain = f"{'+'.join(folded)} folded away with no QuantizeLinear to clamp it"
            carries[output] = end
            if end in wanted and end not in pairs:
                pairs[end] = Pair(
                    end, measured, node.name or output, node.op_type, how, folded, uncertain, tuple(node.input)
                )
    fed, sources = {}, {}
    for node in cand.nodes:
        if node.op_type in QDQ_OPS:
            continue
        for name in node.input:
            source = cand.float_source(name)
            sources[name] = source
            if name != source and source in carries:
                fed[name] = carries[source]
    order = {t: i for i, t in enumerate(floats)}
    ordered = sorted(pairs.values(), key=lambda p: order[p.reference])
    return Pairing(ordered, fed, sources, set(ref.graph_inputs), len(wanted) - len(pairs))


def _carried_inputs(node: onnx.NodeProto, cand: _Graph, carries: dict[str, str]) -> list[str | None]:
    """For each input computed from the graph inputs: the reference tensor it carries (None: unknown)."""
    found: list[str | None] = []
    for name in node.input:
        source = cand.float_source(name)
        if source in cand.dynamic:
            found.append(carries.get(source))
    return found


def _reference_node(
    node: onnx.NodeProto, inputs: list[str | None], ref: _Graph, ref_by_name: dict[str, onnx.NodeProto]
) -> tuple[onnx.NodeProto | None, str]:
    """The reference node ``node`` computes, and how it was found (by output name, node name or inputs)."""
    op = EQUIVALENT_OPS.get(node.op_type, node.op_type)
    known = [i for i in inputs if i is not None]

    def agrees(match: onnx.NodeProto) -> bool:
        return match.op_type == op and all(i in match.input for i in known)

    for output in node.output:
        match = ref.producer(output)
        if match is not None and agrees(match):
            return match, "name"
    match = ref_by_name.get(node.name)
    if match is not None and agrees(match):
        return match, "node name"
    if known and len(known) == len(inputs):
        found = [c for c in ref.consumers.get(known[0], []) if c.op_type == op and _dynamic(c, ref) == known]
        if len(found) == 1:
            return found[0], "structure"
    return None, ""


def _dynamic(node: onnx.NodeProto, graph: _Graph) -> list[str]:
    return [i for i in node.input if i in graph.dynamic]


def _follow_folded(
    start: str, node: onnx.NodeProto, output: str, ref: _Graph, cand: _Graph, carries: dict[str, str]
) -> tuple[str, tuple[str, ...]]:
    """The end of the reference chain of foldable ops after ``start`` that the candidate does not compute."""
    tensor, folded = start, []
    computed_next = {c.op_type for c in cand.reads(output)}
    while True:
        consumers = ref.consumers.get(tensor, [])
        if len(consumers) != 1 or tensor in ref.graph_outputs:
            break
        nxt = consumers[0]
        if nxt.op_type not in FOLDABLE_OPS or nxt.op_type in computed_next or len(nxt.output) < 1:
            break
        others = [i for i in nxt.input[1:] if i]
        if any(i in ref.dynamic for i in others):  # a residual Add: not a fold
            break
        if nxt.op_type in AFFINE_OPS and nxt.input[0] != tensor:
            break
        tensor = nxt.output[0]
        folded.append(nxt.op_type)
        if output == tensor:  # the candidate named its output after this tensor: the chain ends here
            break
    return tensor, tuple(folded)


def _pair_by_name(
    node: onnx.NodeProto,
    output: str,
    known_inputs: list[str | None],
    ref: _Graph,
    wanted: set[str],
    pairs: dict[str, Pair],
    carries: dict[str, str],
) -> None:
    """No reference node matches by structure: pair ``output`` with the same-named reference tensor."""
    if output not in wanted or output in pairs:
        return
    carries[output] = output
    producer = ref.producer(output)
    assert producer is not None  # a wanted tensor has a producer
    # The name is all there is. It is contradicted only when the node reads known reference tensors
    # that the same-named reference node does not (a node of another type that computes the same value,
    # like the scaling Mul after MatMulInteger, reads nothing known).
    known = [c for c in known_inputs if c is not None]
    uncertain = ""
    if producer.op_type != EQUIVALENT_OPS.get(node.op_type, node.op_type) and not all(
        i in producer.input for i in known
    ):
        uncertain = f"named like the output of {producer.op_type} {producer.name or output}, which reads other tensors"
    pairs[output] = Pair(output, output, node.name or output, node.op_type, "name", (), uncertain, tuple(node.input))


def measured_tensors(pairing: Pairing) -> Iterable[tuple[str, str]]:
    """(candidate tensor, reference tensor) for everything to expose: the pairs, then the fed copies."""
    seen = set()
    for p in pairing.pairs:
        seen.add(p.candidate)
        yield p.candidate, p.reference
    for name, source in pairing.fed.items():
        if name not in seen:
            seen.add(name)
            yield name, source
