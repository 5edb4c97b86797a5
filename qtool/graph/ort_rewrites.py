"""onnxruntime graph rewrites that change what an fp8 Q/DQ model computes, and which models need them off.

onnxruntime's CPU provider (1.32 and before) removes a Relu whose only reader is a QuantizeLinear
(``ReluQuantRewrite``), reasoning that the quantization clips at zero anyway. That holds for a uint8
zero point of 0 or an int8 one of -128; its check reads no other type, so it also fires before an
fp8 QuantizeLinear, whose grid is symmetric: the negative values the Relu would have zeroed pass
through (the sample CNN falls from 30 dB to -2 dB). The graph is right (TensorRT fuses exactly this
Conv -> Relu -> Q); qtool's own sessions turn the rewrite off for such models, and quantize says so.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto

from qtool.graph.index import GraphView

RELU_QUANT_REWRITE = "ReluQuantRewrite"
_FLOAT8 = frozenset(
    {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ}
)


def fp8_relu_quantizers(model: onnx.ModelProto) -> list[str]:
    """The Relu nodes of the main graph whose only reader is a QuantizeLinear to a float8 type."""
    if not any(i.data_type in _FLOAT8 for i in model.graph.initializer):  # no float8 zero point: no such quantizer
        return []
    view = GraphView(model)
    found = []
    for node in view.nodes:
        if node.op_type != "Relu" or node.domain not in ("", "ai.onnx") or not node.output:
            continue
        users = view.input_readers(node.output[0])
        quantizer = users[0] if len(users) == 1 and users[0].op_type == "QuantizeLinear" else None
        if quantizer is None or len(quantizer.input) <= 2:
            continue
        zero = view.every_initializer.get(quantizer.input[2])
        if zero is not None and zero.data_type in _FLOAT8:
            found.append(node.name or node.output[0])
    return found


def fp8_relu_note(model: onnx.ModelProto) -> str | None:
    """What a user running ``model`` on onnxruntime's CPU provider must know (None: nothing)."""
    relus = fp8_relu_quantizers(model)
    if not relus:
        return None
    return (
        f"{len(relus)} Relu feed fp8 QuantizeLinear nodes: onnxruntime's CPU provider (1.32 and before) drops such "
        f"a Relu; qtool's sessions turn that rewrite off, do the same in yours: "
        f"InferenceSession(..., disabled_optimizers=['{RELU_QUANT_REWRITE}']) (TensorRT is not affected)"
    )


def unsafe_rewrites(model: onnx.ModelProto | str | Path) -> list[str]:
    """The onnxruntime rewrites to turn off for ``model`` (a path is read without its external data)."""
    if not isinstance(model, onnx.ModelProto):
        try:
            model = onnx.load(str(model), load_external_data=False)
        except Exception:  # noqa: BLE001 - onnxruntime then refuses the file itself, naming it
            return []
    return [RELU_QUANT_REWRITE] if fp8_relu_quantizers(model) else []
