"""Empirical bias correction: measure each quantized layer's own mean output error, fold it into its bias.

In an all-integer model a layer's output mean drifts for two local reasons: its rounded weight
and its rounded input (values below half a step after a Relu all round one way). Both show in
one run of the quantized model: for layer ``l`` with float input ``x`` as the quantized model
computes it (before its QuantizeLinear), the error it adds is ``E[y_l] - (W E[patch(x)] + b)``.
Correcting each layer by its *own* error, measured on inputs that already carry the upstream
errors, never counts an upstream error twice (correcting every layer by ``E[y_q] - E[y_float]``
would: the downstream layers would also cancel what their upstream correction already removed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qtool.calibration.statistics import with_exposed_outputs
from qtool.graph.index import GraphView
from qtool.graph.session import Feed, create_session, run_session
from qtool.graph.weights import Weights
from qtool.quantization.algorithms.rounding.bias_correction import mean_output
from qtool.quantization.algorithms.rounding.gptq import weight_rows
from qtool.quantization.algorithms.rounding.node_inputs import NodeInput
from qtool.quantization.algorithms.rounding.patches import ConvGeometry, input_stats

# A layer with fewer output positions per channel over the measured samples (a squeeze-excitation
# Conv on a pooled tensor, a classifier head) has a mean error estimate made mostly of sampling noise,
# and correcting a head by it moves its few outputs by that noise: such layers are not corrected.
MIN_POSITIONS = 100


@dataclass(frozen=True)
class MeasuredLayer:
    """Where one layer of the quantized model reads its float input and writes its raw output."""

    node: str
    source: str  # the float tensor the layer's input QuantizeLinear reads (or the input itself)
    output: str  # the layer's own output, before any bias Add or requantization
    layout: NodeInput
    weight: np.ndarray  # the float weight
    bias: np.ndarray | None  # the float bias inside the node (Conv, Gemm), None for MatMul


def float_source(model: onnx.ModelProto, tensor: str) -> str:
    """The float tensor behind ``tensor``: through a DequantizeLinear and the QuantizeLinear before it."""
    view = GraphView(model)
    node = view.producer(tensor)
    if node is None or node.op_type != "DequantizeLinear":
        return tensor
    quantizer = view.producer(node.input[0])
    if quantizer is None or quantizer.op_type != "QuantizeLinear":
        return tensor
    return quantizer.input[0]


def measure_shifts(
    quantized: onnx.ModelProto, store: Weights, layers: Sequence[MeasuredLayer], feeds: Sequence[Feed]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Node -> what to add to its float bias, from one run of ``quantized`` over ``feeds``.

    Layers seen at fewer than ``MIN_POSITIONS`` output positions per channel are left out (with the reason).
    """
    if not layers:  # onnxruntime reads an empty output list as "every output"
        return {}, {}
    wanted = list(dict.fromkeys(t for layer in layers for t in (layer.source, layer.output)))
    exposed = with_exposed_outputs(quantized, wanted)
    session = create_session(exposed, "the quantized model (bias correction)", weights=store)
    input_means: dict[str, np.ndarray] = {}
    output_sums: dict[str, np.ndarray] = {}
    input_counts: dict[str, int] = {}
    output_counts: dict[str, int] = {}
    for feed in feeds:
        values = dict(zip(wanted, run_session(session, wanted, feed, "the quantized model"), strict=True))
        for layer in layers:
            stats = input_stats(values[layer.source], layer.layout.geometry, max_positions=1, seed=0)
            input_means[layer.node] = input_means.get(layer.node, 0) + stats.mean_sum
            input_counts[layer.node] = input_counts.get(layer.node, 0) + stats.mean_count
            y = np.asarray(values[layer.output], np.float64)
            axis = 1 if isinstance(layer.layout.geometry, ConvGeometry) else y.ndim - 1
            per_channel = np.moveaxis(y, axis, 0).reshape(y.shape[axis], -1)
            output_sums[layer.node] = output_sums.get(layer.node, 0) + per_channel.sum(axis=1)
            output_counts[layer.node] = output_counts.get(layer.node, 0) + per_channel.shape[1]
    shifts, skipped = {}, {}
    for layer in layers:
        if output_counts[layer.node] < MIN_POSITIONS:
            skipped[layer.node] = (
                f"{output_counts[layer.node]} output positions per channel, too few to estimate its error"
            )
            continue
        mean_patch = input_means[layer.node] / max(input_counts[layer.node], 1)  # [groups, K]
        rows = weight_rows(layer.weight, layer.layout.kind, trans_b=layer.layout.trans_b)
        expected = mean_output(rows, mean_patch)
        if layer.bias is not None:
            expected = expected + layer.bias
        measured = output_sums[layer.node] / max(output_counts[layer.node], 1)
        shifts[layer.node] = (expected - measured).astype(np.float32)
    return shifts, skipped


def measured_layers(
    quantized: onnx.ModelProto, prepared: GraphView, store: Weights, nodes: dict[str, NodeInput]
) -> tuple[list[MeasuredLayer], dict[str, str]]:
    """The layers of ``quantized`` to measure for ``nodes`` (name -> input layout), and why others cannot be.

    ``prepared``: the view of the float model ``quantized`` was written from.
    """
    inits, float_nodes = prepared.every_initializer, prepared.by_name
    layers, skipped = [], {}
    for node in quantized.graph.node:
        if node.name not in nodes:
            continue
        original = float_nodes[node.name]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in original.attribute}
        if float(attrs.get("alpha", 1.0)) != 1.0 or float(attrs.get("beta", 1.0)) != 1.0:
            skipped[node.name] = "Gemm with alpha or beta other than 1"
            continue
        bias_name = original.input[2] if len(original.input) > 2 and original.op_type != "MatMul" else ""
        if bias_name and bias_name not in inits:
            skipped[node.name] = "its bias is computed at run time"
            continue
        bias = store.value(inits[bias_name]).astype(np.float64) if bias_name else None
        if bias is not None and bias.ndim != 1:
            skipped[node.name] = "its bias is not one value per output"
            continue
        layers.append(
            MeasuredLayer(
                node.name,
                float_source(quantized, node.input[0]),
                node.output[0],
                nodes[node.name],
                store.value(inits[original.input[1]]),
                bias,
            )
        )
    return layers, skipped
