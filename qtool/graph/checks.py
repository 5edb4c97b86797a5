"""onnx's checker on a quantized model, told apart from a problem the input model already had."""

from __future__ import annotations

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
