"""Predict which kernel onnxruntime's CPU execution provider will run for each quantized node.

A quantized ONNX model is only faster if onnxruntime fuses its QuantizeLinear /
DequantizeLinear groups into integer kernels; a group it cannot fuse runs in
float with the Q/DQ cost on top. These rules follow onnxruntime's QDQ selectors
and graph transformers (onnxruntime 1.2x-1.3x, CPU EP):

* Conv: DQ on input and weight, Q on the output, 8-bit types -> QLinearConv.
* ConvTranspose: no integer kernel on CPU (the Q/DQ groups stay, around a float ConvTranspose).
* Gemm: DQ on A and B (8-bit), optional int32 bias -> QGemm.
* MatMul with a constant weight: a MatMul + bias Add on 2-D input is first fused
  into Gemm (MatMulAddFusion) -> QGemm; otherwise -> MatMulIntegerToFloat
  (qtool quantizes MatMul outputs after the bias, so no Q follows the MatMul).
* MatMul of two activations with Q on the output -> QLinearMatMul.
* ``weight.format: matmul_nbits``: qtool writes MatMulNBits itself (no fusion needed).
* A block-wise 4/2-bit constant weight along K with float activations ->
  MatMulNBits, when the block size is a power of two >= 16 - unless the 2-D
  MatMul + Add is fused into Gemm first.
* 16-bit activations have no integer kernels on CPU.
* Unweighted ops between integer kernels (:mod:`qtool.quantization.plan.chains`): Add, Mul, Sigmoid,
  LeakyRelu, Concat, AveragePool, GlobalAveragePool, Softmax -> their QLinear kernels; MaxPool,
  Resize, Reshape, Transpose, Split, Slice, Flatten, Squeeze, Unsqueeze run on the 8-bit values
  (the Q/DQ pair around them, one scale on both sides, is dropped).
* ``mode: dynamic`` MatMul/Gemm: DynamicQuantizeLinear + MatMulInteger + Cast + Mul (+ bias Add)
  -> DynamicQuantizeMatMul; where several read one input, it is quantized once and each runs
  MatMulIntegerToFloat. A MatMul of two activations fuses the same way (its B quantized at run time).

For ``target: tensorrt`` every integer node is predicted to fuse into an int8 TensorRT layer (an fp8
one with fp8_e4m3 activations and weights), and for ``target: cuda`` every node to run in float (the
CUDA provider dequantizes Q/DQ models). onnxruntime's CPU provider has no fp8 kernels: fp8 Q/DQ run
around a float op.

The benchmark checks these predictions against the optimized graphs
onnxruntime writes (``bench/run.py`` prints the agreement).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.graph.index import GraphView
from qtool.quantization.plan.records import NodePlan, QuantPlan
from qtool.quantization.plan.roles import CHAIN_OPS, FUSED_KERNELS, folds_into_quantizer
from qtool.schemes import CPU_TARGETS

# the kernels onnxruntime's CPU provider runs a weighted node in, on integers
WEIGHTED_INTEGER_KERNELS = frozenset({"QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulNBits"})


@dataclass(frozen=True)
class KernelPrediction:
    """The kernel onnxruntime is expected to run for one node, and why."""

    node: str
    kernel: str  # e.g. "QLinearConv", or "float Conv"
    integer: bool
    reason: str


def _gemm_fusable_add(node: onnx.NodeProto, view: GraphView, final_outputs: set[str]) -> bool:
    """A constant bias Add after the MatMul that onnxruntime's MatMulAddFusion turns into Gemm.

    It leaves the pair alone when the Add writes a graph output directly.
    """
    users = view.input_readers(node.output[0])
    if len(users) != 1 or users[0].op_type != "Add" or users[0].output[0] in final_outputs:
        return False
    other = [i for i in users[0].input if i != node.output[0]]
    return bool(other) and other[0] in view.every_initializer


def predict_kernels(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, KernelPrediction]:
    """One prediction per planned node of the prepared ``model``."""
    view = GraphView(model)
    nodes = view.by_name
    # graph outputs still written by the float node itself (a quantized one is written by its DequantizeLinear)
    final_outputs = view.graph_outputs - set(plan.activations)
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*model.graph.input, *model.graph.value_info]
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
    }
    shapes = {name: list(i.dims) for name, i in view.every_initializer.items()}
    for value in model.graph.value_info:  # 1-D shape tensors computed at run time (Shape -> Concat)
        dims = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else []
        if len(dims) == 1 and dims[0].HasField("dim_value"):
            shapes.setdefault(value.name, [dims[0].dim_value])
    for name, index in view.producers.items():
        if name in ranks:
            continue
        producer = view.nodes[index]
        # shape inference may leave dynamic-shape models without ranks; two producers make them obvious
        if producer.op_type == "Flatten":
            ranks[name] = 2
        elif producer.op_type == "Reshape" and len(producer.input) > 1 and producer.input[1] in shapes:
            ranks[name] = int(np.prod(shapes[producer.input[1]]))
    if plan.target not in CPU_TARGETS:
        return {p.name: _predict_gpu(p, plan.target) for p in plan.nodes}
    dynamic_inputs = Counter(nodes[p.name].input[0] for p in plan.nodes if p.placement == "dynamic")
    return {p.name: _predict(p, nodes[p.name], view, final_outputs, ranks, dynamic_inputs) for p in plan.nodes}


def float_boundaries(view: GraphView, plan: QuantPlan) -> dict[str, int]:
    """The activation QuantizeLinear / DequantizeLinear nodes no integer kernel absorbs (CPU targets).

    A quantized tensor keeps its QuantizeLinear when a float node (or the caller) writes it, and
    its DequantizeLinear when a float node (or the caller) reads it; between two integer kernels
    both fuse away. Fewer boundaries mean fewer round trips to float.
    """
    integer = {p.name: p for p in plan.nodes if p.placement == "integer" and p.activations}
    written_by_integer = {p.output for p in integer.values() if p.output}
    quantize = dequantize = 0
    for tensor in plan.activations:
        producer = view.producer(tensor)
        if tensor not in written_by_integer and not (producer is not None and producer.name in integer):
            quantize += 1
        readers = view.input_readers(tensor)
        float_reader = any(n.name not in integer or tensor not in integer[n.name].activations for n in readers)
        if float_reader or tensor in view.graph_outputs:
            dequantize += 1
    return {"QuantizeLinear": quantize, "DequantizeLinear": dequantize}


def _predict_chain(p: NodePlan) -> KernelPrediction:
    """An unweighted op between integer kernels (see :mod:`qtool.quantization.plan.chains`)."""
    if p.op_type in FUSED_KERNELS:
        return KernelPrediction(p.name, FUSED_KERNELS[p.op_type], True, "DQ inputs, Q output: fused into one kernel")
    why = "input and output share a scale: the Q/DQ pair is dropped"
    return KernelPrediction(p.name, f"int8 {p.op_type}", True, why)


def _predict_gpu(p: NodePlan, target: str) -> KernelPrediction:
    """What TensorRT, or onnxruntime's CUDA provider, makes of one node."""
    op = p.op_type
    if p.placement == "lookup":
        return KernelPrediction(p.name, "Gather", False, "integer table; the rows read are dequantized after it")
    if target == "cuda":
        why = (
            "weights restored to float at load" if p.placement == "storage" else "CUDA dequantizes Q/DQ: float compute"
        )
        return KernelPrediction(p.name, f"float {op} (CUDA)", False, why)
    if p.placement == "integer":
        activation, weight = p.scheme.activation, p.scheme.weight
        if activation.fp8 or (p.weight is not None and weight.fp8):
            if op == "ConvTranspose" or not activation.fp8 or (p.weight is not None and not weight.fp8):
                why = "no fp8 fusion for it (fp8 layers take fp8_e4m3 on both inputs)"
                return KernelPrediction(p.name, f"float {op} (TensorRT)", False, why)
            return KernelPrediction(
                p.name, f"fp8 {op} (TensorRT)", True, "fp8 Q/DQ on its input and weight fuse into an fp8 layer"
            )
        if op == "ConvTranspose" or p.scheme.activation.dtype != "int8":
            return KernelPrediction(p.name, f"float {op} (TensorRT)", False, "no int8 fusion for it")
        return KernelPrediction(
            p.name, f"int8 {op} (TensorRT)", True, "Q/DQ on its input and weight fuse into an int8 layer"
        )
    if p.placement == "weight_only":
        return KernelPrediction(p.name, f"{op} weight-only (TensorRT)", False, "weights dequantized inside the layer")
    return KernelPrediction(p.name, f"float {op} (TensorRT)", False, f"placement {p.placement}: float activations")


def _predict(
    p: NodePlan,
    node: onnx.NodeProto,
    view: GraphView,
    final_outputs: set[str],
    ranks: dict[str, int],
    dynamic_inputs: Counter[str],
) -> KernelPrediction:
    op = p.op_type
    if op in CHAIN_OPS and p.weight is None:
        return _predict_chain(p)
    fused_with_add = ranks.get(node.input[0]) == 2 and _gemm_fusable_add(node, view, final_outputs)
    if p.placement == "storage":
        return KernelPrediction(p.name, f"float {op}", False, "placement storage: weights restored to float at load")
    if p.placement == "lookup":
        return KernelPrediction(p.name, "Gather", False, "integer table; the rows read are dequantized after it")
    if p.placement == "dynamic":
        if dynamic_inputs[node.input[0]] > 1:
            why = "input quantized once at run time for all its dynamic readers, 8-bit weights (bias Add fused)"
            return KernelPrediction(p.name, "MatMulIntegerToFloat", True, why)
        why = "input quantized at run time, 8-bit weights (bias Add fused)"
        return KernelPrediction(p.name, "DynamicQuantizeMatMul", True, why)
    if p.placement == "weight_only":
        return _predict_weight_only(p, fused_with_add)
    # the output quantized right after the MatMul (or a Relu or ReLU6 it alone feeds), not after a bias Add
    direct = p.output == node.output[0] or any(
        folds_into_quantizer(c, view) and c.output[0] == p.output for c in view.input_readers(node.output[0])
    )
    return _predict_integer(p, fused_with_add, direct)


def _predict_weight_only(p: NodePlan, fused_with_add: bool) -> KernelPrediction:
    """A weight-only node: fp16, MatMulNBits, or DequantizeLinear before a float op."""
    op, spec = p.op_type, p.scheme.weight
    if spec.fp16:
        return KernelPrediction(p.name, f"float {op}", False, "fp16 weights are cast to float at load")
    if spec.format == "matmul_nbits":
        block = p.weight.block_size if p.weight else None
        level = f", accuracy_level {spec.accuracy_level}" if spec.accuracy_level else ""
        why = f"written as MatMulNBits: {spec.dtype} blocks of {block} along K{level}"
        return KernelPrediction(p.name, "MatMulNBits", True, why)
    block = p.weight.block_size if p.weight else None
    if op == "MatMul" and block is not None:
        if block < 16 or block & (block - 1):
            return KernelPrediction(
                p.name, "float MatMul", False, f"MatMulNBits needs a power-of-two block_size >= 16, not {block}"
            )
        if p.weight is not None and p.weight.axis != 0:
            return KernelPrediction(p.name, "float MatMul", False, "MatMulNBits needs blocks along K (axis 0)")
        if fused_with_add:
            return KernelPrediction(
                p.name,
                "float Gemm",
                False,
                "2-D MatMul + bias Add is fused into Gemm before MatMulNBits can apply; "
                "DequantizeLinear runs on every call",
            )
        return KernelPrediction(p.name, "MatMulNBits", True, f"{spec.dtype} blocks of {block} along K")
    return KernelPrediction(p.name, f"float {op}", False, "weight-only: DequantizeLinear runs on every call")


def _predict_integer(p: NodePlan, fused_with_add: bool, direct: bool) -> KernelPrediction:
    """A node placed integer on the CPU: which kernel onnxruntime fuses it into, if any."""
    op, spec = p.op_type, p.scheme.weight
    if p.scheme.activation.fp8 or spec.fp8:
        return KernelPrediction(
            p.name, f"float {op}", False, f"fp8 Q/DQ run around a float {op} (no fp8 kernels on CPU)"
        )
    if p.scheme.activation.dtype not in ("uint8", "int8"):
        return KernelPrediction(
            p.name, f"float {op}", False, f"{p.scheme.activation.dtype} activations have no integer kernels on CPU"
        )
    if op == "ConvTranspose":
        return KernelPrediction(
            p.name, "float ConvTranspose", False, "no integer ConvTranspose kernel: Q/DQ run around a float one"
        )
    if op == "Conv":
        if p.output is None:
            return KernelPrediction(p.name, "float Conv", False, "the output is not quantized")
        return KernelPrediction(p.name, "QLinearConv", True, "DQ inputs and weight, Q output")
    if op == "Gemm":
        return KernelPrediction(p.name, "QGemm", True, "DQ inputs and weight")
    if p.weight is None:
        if p.output is None:
            return KernelPrediction(p.name, "float MatMul", False, "the output is not quantized")
        return KernelPrediction(p.name, "QLinearMatMul", True, "both inputs and the output quantized")
    if fused_with_add:
        return KernelPrediction(p.name, "QGemm", True, "2-D MatMul + bias Add fused into Gemm, then QGemm")
    if direct:
        return KernelPrediction(p.name, "QLinearMatMul", True, "DQ input and weight, Q output")
    return KernelPrediction(p.name, "MatMulIntegerToFloat", True, "DQ inputs and weight, float output")
