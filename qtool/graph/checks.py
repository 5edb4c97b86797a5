"""onnx's checker on a quantized model, told apart from a problem the input model already had."""

from __future__ import annotations

import functools

import onnx

from qtool.errors import QtoolError
from qtool.graph.weights import checkable


def _full_check_error(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(checkable(model), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        return str(e).strip().splitlines()[0]
    return None


def check_quantized_model(model: onnx.ModelProto, source: onnx.ModelProto) -> str | None:
    """Run onnx's full checker on the quantized model.

    If the float ``source`` model already fails the full check (a wrongly declared
    output shape, say), the quantized model only has to pass the basic check, and
    the source's problem is returned as a note. Any other failure is a qtool bug.
    """
    error = _full_check_error(model)
    if error is None:
        return None
    source_error = _full_check_error(source)
    if source_error is None:
        raise RuntimeError(f"qtool produced a model that fails onnx.checker: {error}")
    try:
        onnx.checker.check_model(checkable(source))
    except onnx.checker.ValidationError as e:  # the input itself is invalid: the user's to fix, not a qtool bug
        raise QtoolError(f"the input model fails onnx's checker: {str(e).strip().splitlines()[0]}") from e
    try:
        onnx.checker.check_model(checkable(model))
    except onnx.checker.ValidationError as e:
        raise RuntimeError(f"qtool produced a model that fails onnx.checker: {e}") from e
    return f"the input model fails onnx's full check ({source_error}); the output passed the basic check"


def refuse_unknown_ops(model: onnx.ModelProto, source: str) -> None:
    """Raise, naming the first node, when an op of the ONNX domains is neither ONNX's nor one onnxruntime registers.

    An exporter can leave an op of its own framework unconverted in the default domain (tf2onnx's ``Erfc`` for an
    exact GELU, ``TFL_GELU`` or ``TensorListReserve`` from a TFLite file): no runtime loads such a model, and the
    error would otherwise surface later as onnxruntime refusing qtool's prepared model.
    """
    known = _runtime_schemas()
    if known is None:  # an onnxruntime build that does not list its schemas: it judges at load
        return
    for node in model.graph.node:
        domain = node.domain or ""
        if domain not in ("", "ai.onnx", "ai.onnx.ml") or onnx.defs.has(node.op_type, domain):
            continue
        if ("" if domain == "ai.onnx" else domain, node.op_type) not in known:
            where = f"node '{node.name}'" if node.name else f"the node computing '{node.output[0]}'"
            raise QtoolError(
                f"{source}: {where} is '{node.op_type}', which is no ONNX operator: onnxruntime cannot load "
                "this model (the exporter left an op of its own framework unconverted)",
                hint="export again with a converter that supports it, or replace the op before quantizing",
            )


@functools.cache
def _runtime_schemas() -> frozenset[tuple[str, str]] | None:
    """(domain, op) of every schema onnxruntime registers (its contrib ops in the ONNX domain too); None: unlisted."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as runtime

        return frozenset((schema.domain, schema.name) for schema in runtime.get_all_operator_schema())
    except (ImportError, AttributeError, RuntimeError):
        return None
