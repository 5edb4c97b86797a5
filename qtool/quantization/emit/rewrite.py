"""Plan + qparams -> a new graph with QuantizeLinear / DequantizeLinear nodes.

Naming keeps the float tensor names a user sees: a quantized activation ``T``
produced by a node is renamed ``T/float`` at its producer, and the
DequantizeLinear that follows writes ``T`` again, so every consumer (and a graph
output) reads the dequantized value under the original name. Weights become
integer initializers ``W/quantized`` whose DequantizeLinear writes ``W``. One
Q/DQ pair exists per tensor, shared by all its consumers; a weight is stored once
per quantization grid, whatever placement its readers get (see
:mod:`qtool.quantization.emit.weight_copies`). Every generated name is derived from
tensor names, so the same inputs give the same graph.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

from qtool.errors import QtoolError
from qtool.graph.index import GraphView, subgraph_reads
from qtool.graph.weights import Weights
from qtool.numerics.matmul_nbits import DOMAIN as CONTRIB_DOMAIN
from qtool.numerics.qparams import QParams, quantize_bias
from qtool.numerics.saturation import pair_guard
from qtool.quantization.algorithms.rounding.weight_rounding import WeightAlgorithms
from qtool.quantization.emit.body_weights import store_outer_weights
from qtool.quantization.emit.branches import write_branches
from qtool.quantization.emit.propagation import read_float_before_bodies
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.emit.stored_forms import Names, StoredForms
from qtool.quantization.emit.weight_codes import WeightCodes
from qtool.quantization.emit.weight_copies import (
    FP16,
    GATHERED,
    INTEGERS,
    NBITS,
    RESTORED,
    CopyKey,
    WeightUse,
    weight_uses,
)
from qtool.quantization.plan.planner import passthrough_ops
from qtool.quantization.plan.records import NodePlan, QuantPlan

log = logging.getLogger(__name__)


class _Rewriter:
    """One rewrite of one model; see the module docstring for the naming rules."""

    def __init__(
        self,
        model: onnx.ModelProto,
        plan: QuantPlan,
        act_qparams: dict[str, QParams],
        store: Weights,
        algorithms: WeightAlgorithms | None = None,
        bias_shifts: dict[str, np.ndarray | None] | None = None,
        correct_biases: bool = True,
    ) -> None:
        self.store = store  # the values of detached initializers
        self.algorithms = algorithms
        self.bias_shifts = bias_shifts
        self.correct_biases = correct_biases
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.graph = self.model.graph
        self.plan = plan
        self.act_qparams = act_qparams
        self.names = Names(self.graph)
        view = self.view = GraphView(self.model)  # the model as given: what the rewrite reads, not what it adds
        self.inits, self.graph_inputs = view.every_initializer, view.graph_inputs
        self.nodes = view.by_name
        self.planned_outputs, self.planned = {n.output for n in plan.nodes if n.output}, {n.name for n in plan.nodes}
        self.prologue: list[onnx.NodeProto] = []  # DQ of weights, Q/DQ of graph inputs and constants
        self.forms = StoredForms(self.names, self.graph, self.prologue)
        self.after: dict[str, list[onnx.NodeProto]] = {}  # tensor -> Q/DQ to emit after its producer
        self.replaced: set[str] = set()  # float initializers replaced by integer ones (dropped once unread)
        self.uses = weight_uses(plan.nodes)
        self.copies: dict[tuple[str, CopyKey], tuple[str, QParams | None]] = {}  # stored integers and their qparams
        self.restored: dict[tuple[str, CopyKey, str], str] = {}  # (weight, copy, form) -> the float tensor
        self.replacements: dict[str, list[onnx.NodeProto]] = {}  # node -> the nodes that compute it instead
        self.report = RewriteReport()
        self.weight_codes = WeightCodes(plan, self.uses, store, self.inits, act_qparams, algorithms, self.report)
        self.consumers = view.consumers  # (an If/Loop/Scan's bodies' reads are not among them)

    def _rename_input(self, node: onnx.NodeProto, old: str, new: str) -> None:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new

    def _sole_reader(self, tensor: str, node_name: str) -> bool:
        readers = self.consumers.get(tensor, [])
        return tensor not in self.graph_inputs and all(n.name == node_name for n in readers)

    # -- roles --------------------------------------------------------------
    def quantize_activation(self, tensor: str, readers: list[str]) -> None:
        """Insert one Q/DQ pair for ``tensor``.

        The quantized output of a planned node is read by every consumer (what onnxruntime needs to fuse the
        producer into an integer kernel; but see :mod:`.propagation`). Any other tensor (a graph input, a constant,
        the output of a float node) is only rewired for the planned ``readers``; other consumers keep the float value.
        """
        qp = self.act_qparams[tensor]
        scale, zero = self.forms.add_qparam_inits(tensor, qp)
        quantized = self.names.new(f"{tensor}/quantized")
        produced_here = tensor not in self.graph_inputs and tensor not in self.inits
        if tensor in self.planned_outputs and produced_here:
            source, output = self.names.new(f"{tensor}/float"), tensor
            producer = self.view.nodes[self.view.producers[tensor]]
            producer.output[list(producer.output).index(tensor)] = source
            read_float_before_bodies(self.view, tensor, source, self.planned)
        else:
            source, output = tensor, self.names.new(f"{tensor}/dequantized")
            for name in readers:
                self._rename_input(self.nodes[name], tensor, output)
        # Emitted right after whatever writes ``source`` (its producer), or first for inputs and constants.
        target = self.after.setdefault(source, []) if produced_here else self.prologue
        target.append(
            helper.make_node(
                "QuantizeLinear", [source, scale, zero], [quantized], name=self.names.new(f"{tensor}/QuantizeLinear")
            )
        )
        target.append(self.forms.dq_node(tensor, quantized, scale, zero, output, None))
        self.report.quantized_activations.append(tensor)

    def _stored_copy(self, use: WeightUse, values: np.ndarray) -> tuple[str, QParams | None]:
        """The integers ``use`` reads (with their qparams), quantized and stored on first use."""
        if (use.weight, use.copy) in self.copies:
            return self.copies[(use.weight, use.copy)]
        qp, codes = self.weight_codes.of(use, values)
        self.copies[(use.weight, use.copy)] = (self.forms.integers(use.weight, codes, qp), qp)
        self.report.quantized_weights.append(use.weight)
        return self.copies[(use.weight, use.copy)]

    def _restore(self, use: WeightUse) -> str:
        """Write the float tensor ``use`` reads: its copy (stored on first use) and the nodes that restore it."""
        weight = use.weight
        values = self.store.value(self.inits[weight])
        planned = [name for name, u in self.uses.items() if u.weight == weight]
        readers = {n.name for n in self.consumers.get(weight, [])}
        forms = {(u.copy, u.form) for u in self.uses.values() if u.weight == weight}
        # Only a weight whose readers all read one float form keeps its name.
        if readers <= set(planned) and len(forms) == 1:
            output = weight
        else:
            output = self.names.new(f"{weight}/{'restored' if use.form == RESTORED else 'dequantized'}")
        if use.form in (INTEGERS, GATHERED):  # read as stored: by MatMulInteger, or by a Gather
            stored, _ = self._stored_copy(use, values)
            self.replaced.add(weight)
            return stored
        if use.form == FP16:
            self.forms.fp16(weight, values, output)
            self.copies[(weight, use.copy)] = (output, None)
            self.report.quantized_weights.append(weight)
        else:
            stored, qp = self._stored_copy(use, values)
            assert qp is not None  # only float16 copies have none
            if use.form == RESTORED:
                self.forms.restored_at_load(weight, stored, qp, output, values.shape)
            else:
                # A symmetric weight needs no zero point, except where onnxruntime fuses it into an integer kernel
                # (its QGemm fusion wants one) and for TensorRT, whose parser is not checked without one
                keep = any(p.quantized_inputs for p in self.weight_codes.readers(use)) or self.plan.target == "tensorrt"
                self.forms.dequantized(weight, stored, qp, output, zero_point=keep)
        self.replaced.add(weight)
        return output

    def quantize_weight(self, node: NodePlan) -> QParams | None:
        """Make the node read its weight's float form; returns the stored copy's qparams (None for fp16)."""
        use = self.uses[node.name]
        if use.form == NBITS:  # the MatMul becomes a MatMulNBits holding the packed weight itself
            values = self.store.value(self.inits[use.weight])
            qp, codes = self.weight_codes.of(use, values)
            onnx_node = self.nodes[node.name]
            trans_b = self.gemm_trans_b(node)
            self.replacements[node.name] = self.forms.matmul_nbits(onnx_node, codes, qp, node.scheme.weight, trans_b)
            if use.weight not in self.report.quantized_weights:
                self.report.quantized_weights.append(use.weight)
            self.replaced.add(use.weight)
            return qp
        key = (use.weight, use.copy, use.form)
        if key not in self.restored:
            self.restored[key] = self._restore(use)
        if self.restored[key] != use.weight:
            self._rename_input(self.nodes[node.name], use.weight, self.restored[key])
        return self.copies[(use.weight, use.copy)][1]

    def quantize_bias(self, node: NodePlan, weight_qp: QParams, shift: np.ndarray | None = None) -> None:
        """Store the node's bias as int32 on the input x weight scale (plus ``shift``, from bias correction)."""
        assert node.bias is not None  # the caller checks
        values = self.store.value(self.inits[node.bias])
        if shift is not None:
            values = (values + shift).astype(np.float32)
        if self._sole_reader(node.bias, node.name):
            output = node.bias
        else:  # a shared bias: each node gets its own int32 copy under its own name
            output = self.names.new(f"{node.bias}/{node.name}")
            self._rename_input(self.nodes[node.name], node.bias, output)
        self._int32_bias(node, values, weight_qp, output)
        self.replaced.add(node.bias)
        self.report.quantized_biases.append(node.bias)

    def _int32_bias(self, node: NodePlan, values: np.ndarray, weight_qp: QParams, output: str) -> None:
        input_qp = self.act_qparams[node.activations[0]]
        q, qp = quantize_bias(values, input_qp.scale, weight_qp.scale)
        self.forms.dequantized(output, self.forms.integers(output, q, qp), qp, output)

    # -- bias correction ------------------------------------------------------
    def _bias_shift(self, node: NodePlan, weight_qp: QParams | None) -> np.ndarray | None:
        """Bias correction's shift for ``node`` (None: not asked for, or not possible)."""
        if self.algorithms is None or weight_qp is None or not node.scheme.algorithms.bias_correction:
            return None
        assert node.weight is not None  # only nodes with a weight get here
        shifts = self.bias_shifts or {}
        measured = node.name in shifts
        if measured:  # measured on the quantized model (empirical_bias); None: the measurement skipped it
            shift = shifts[node.name]
        elif not self.correct_biases:  # the pass that measures the errors: no correction yet
            shift = None
        else:
            use = self.uses[node.name]
            values = self.store.value(self.inits[node.weight.name])
            shift = self.algorithms.bias_shift(node, values, self.weight_codes.codes[(use.weight, use.copy)], weight_qp)
            alpha = next((a.f for a in self.nodes[node.name].attribute if a.name == "alpha"), 1.0)
            shift = None if shift is None else (shift * alpha).astype(np.float32)  # in output units
        if shift is None and self.correct_biases and not measured:  # (measured skips: the caller's)
            why = self.algorithms.inputs.skipped.get(node.name, "its inputs were not observed")
            self.report.algorithm_notes.setdefault(node.name, f"bias_correction: {why}")
        return shift

    def correct_bias(self, node: NodePlan, weight_qp: QParams, shift: np.ndarray) -> bool:
        """Add ``shift`` (in output units) to a bias the integer path does not store (float, absent, MatMul's Add)."""
        onnx_node = self.nodes[node.name]
        attrs = {a.name: helper.get_attribute_value(a) for a in onnx_node.attribute}
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        if node.op_type == "MatMul":
            return self._correct_matmul_add(node, shift)
        if node.op_type not in ("Conv", "Gemm") or beta == 0.0:
            self.report.algorithm_notes[node.name] = "bias_correction: the node has no bias to correct"
            return False
        shift = (shift / beta).astype(np.float32)  # Gemm: Y = alpha A B + beta C
        present = len(onnx_node.input) > 2 and onnx_node.input[2] != ""
        if present and onnx_node.input[2] not in self.inits:
            self.report.algorithm_notes[node.name] = "bias_correction: its bias is computed at run time"
            return False
        current = self.store.value(self.inits[onnx_node.input[2]]) if present else np.zeros_like(shift)
        values = (current + shift).astype(np.float32)
        output = self.names.new(f"{node.name}/corrected_bias")
        integer = node.placement == "integer" and bool(node.activations) and (alpha, beta) == (1.0, 1.0)
        integer = integer and not weight_qp.qtype.float8 and not node.scheme.activation.fp8  # fp8: a float bias
        if integer and not present and values.ndim == 1 and weight_qp.block_size is None:
            self._int32_bias(node, values, weight_qp, output)
        else:
            self.graph.initializer.append(onnx.numpy_helper.from_array(values, output))
        if present:
            self.replaced.add(onnx_node.input[2])
            onnx_node.input[2] = output
        else:
            onnx_node.input.append(output)
        return True

    def _correct_matmul_add(self, node: NodePlan, shift: np.ndarray) -> bool:
        """A MatMul's bias lives in the Add after it: correct that constant when only this Add reads it."""
        readers = self.consumers.get(self.nodes[node.name].output[0], [])
        add = readers[0] if len(readers) == 1 and readers[0].op_type == "Add" else None
        constant = next((t for t in add.input if t in self.inits), None) if add is not None else None
        if add is None or constant is None or not self._sole_reader(constant, add.name):
            self.report.algorithm_notes[node.name] = "bias_correction: no bias Add of its own follows the MatMul"
            return False
        current = self.store.value(self.inits[constant])
        if current.shape[-1:] != shift.shape:
            self.report.algorithm_notes[node.name] = "bias_correction: the Add after it is not a bias"
            return False
        output = self.names.new(f"{constant}/corrected")
        self.graph.initializer.append(onnx.numpy_helper.from_array((current + shift).astype(np.float32), output))
        self._rename_input(add, constant, output)
        self.replaced.add(constant)
        return True

    # -- driver -------------------------------------------------------------
    def _record_pair_guard(self, node: NodePlan) -> None:
        """Note how an integer kernel's 8-bit weight is stored against pair saturation (the reports' weight_forms)."""
        spec = node.scheme.weight
        if not node.quantized_inputs or spec.dtype not in ("int8", "uint8"):
            return
        fit = self.report.pair_fits.get(node.name)
        guard = pair_guard(spec.saturation, spec.dtype, node.reduced_weight_range, node.pair_layout, fit)
        self.report.weight_forms[node.name] = guard

    def run(self) -> tuple[onnx.ModelProto, RewriteReport]:
        readers: dict[str, list[str]] = {}
        for plan_node in self.plan.nodes:
            for tensor in plan_node.activations:
                readers.setdefault(tensor, []).append(plan_node.name)
        for tensor in self.plan.activations:
            self.quantize_activation(tensor, readers.get(tensor, []))
        for plan_node in self.plan.nodes:
            if plan_node.weight is not None:
                weight_qp = self.quantize_weight(plan_node)
                self._record_pair_guard(plan_node)
                shift = self._bias_shift(plan_node, weight_qp)
                corrected = False
                if plan_node.bias is not None and plan_node.activations and weight_qp is not None:
                    self.quantize_bias(plan_node, weight_qp, shift)
                    corrected = shift is not None
                elif shift is not None and weight_qp is not None:
                    corrected = self.correct_bias(plan_node, weight_qp, shift)
                if corrected:
                    self.report.algorithms.setdefault(plan_node.name, []).append("bias_correction")
                use = self.uses[plan_node.name]
                if use.form == GATHERED and weight_qp is not None:
                    rank = len(self.inits[plan_node.weight.name].dims)
                    self.replacements[plan_node.name] = self.forms.gathered(self.nodes[plan_node.name], weight_qp, rank)
                if plan_node.placement == "dynamic" and weight_qp is not None:
                    self.replacements[plan_node.name] = self.forms.dynamic_matmul(
                        self.nodes[plan_node.name], weight_qp, self.gemm_trans_b(plan_node)
                    )
                self.store.release([plan_node.weight.name])  # a weight read from a file: its pages are no longer needed
            elif plan_node.placement == "dynamic":  # two activations, both quantized at run time
                self.replacements[plan_node.name] = self.forms.dynamic_matmul(self.nodes[plan_node.name], None, False)
            (self.report.chained_nodes if plan_node.chained else self.report.quantized_nodes).append(plan_node.name)
        self.report.passthrough = passthrough_ops(self.model, self.plan)
        copies = Counter(weight for weight, _ in self.copies)
        self.report.weight_copies = {weight: count for weight, count in copies.items() if count > 1}
        for weight, count in self.report.weight_copies.items():
            log.info("weight %s is stored %d times: its readers ask for different quantization schemes", weight, count)
        self._assemble()
        return self.model, self.report

    def gemm_trans_b(self, node: NodePlan) -> bool:
        return node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in self.nodes[node.name].attribute)

    def _assemble(self) -> None:
        nodes: list[onnx.NodeProto] = list(self.prologue)
        for node in self.graph.node:
            produced = list(node.output)
            nodes.extend(self.replacements.get(node.name, [node]))
            for name in produced:
                nodes.extend(self.after.get(name, []))
        read = {name for node in nodes for name in [*node.input, *subgraph_reads(node)]}
        read |= {o.name for o in self.graph.output}
        written = {name for node in nodes for name in node.output}
        # A replaced float weight stays only while a float node still reads it under its own name.
        kept_inits = [
            i
            for i in self.graph.initializer
            if i.name not in self.replaced or (i.name in read and i.name not in written)
        ]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept_inits)
        # Shape information of renamed tensors is stale; onnxruntime re-infers it.
        del self.graph.value_info[:]
        if self.forms.contrib_ops and not any(o.domain == CONTRIB_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))


def insert_qdq(
    model: onnx.ModelProto,
    plan: QuantPlan,
    act_qparams: dict[str, QParams],
    weights: Weights | None = None,
    algorithms: WeightAlgorithms | None = None,
    bias_shifts: dict[str, np.ndarray | None] | None = None,
    *,
    correct_biases: bool = True,
) -> tuple[onnx.ModelProto, RewriteReport]:
    """Return a copy of ``model`` with Q/DQ nodes and integer weights as ``plan`` says (its bodies too).

    Args:
        model: the prepared float model the plan was built from.
        plan: what to quantize.
        act_qparams: scale / zero point of every tensor in ``plan.activations``.
        weights: the values of ``model``'s detached initializers; the result shares them.
        algorithms: the calibration inputs for GPTQ and bias correction (None: nearest rounding only).
        bias_shifts: bias corrections measured on the quantized model, by node, instead of the analytic ones
            (None for a node the measurement had to skip); nodes not in it get the analytic correction.
        correct_biases: False for the rewrite whose errors bias correction measures.

    Raises QtoolError when an activation in the plan has no qparams.
    """
    if missing := [t for t in plan.activations if t not in act_qparams]:
        raise QtoolError(
            f"no statistics for tensor '{missing[0]}' ({len(missing)} tensors missing)",
            hint="re-run qtool calibrate with the same model and config",
        )
    store = weights if weights is not None else Weights()
    rewriter = _Rewriter(model, plan, act_qparams, store, algorithms, bias_shifts, correct_biases)
    rewritten, report = rewriter.run()
    report.merge(write_branches(rewritten, model, plan, lambda sub, p: insert_qdq(sub, p, act_qparams, store), store))
    store_outer_weights(rewritten, plan, store, rewriter.restored, report)
    return rewritten, report
