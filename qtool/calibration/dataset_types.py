"""The records a dataset yields: a model input's spec (read from the model) and a feed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from qtool.errors import QtoolError
from qtool.graph.session import Feed  # noqa: F401 - the datasets' word for it too

Dim = int | str | None


@dataclass(frozen=True)
class InputSpec:
    """A model input: name, numpy dtype and shape (str/None for dynamic dimensions)."""

    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...] | None  # None: the model does not say (any rank)

    @property
    def dynamic_batch(self) -> bool:
        return self.shape is None or (bool(self.shape) and not isinstance(self.shape[0], int))

    def describe(self) -> str:
        if self.shape is None:
            return f"any shape, {self.dtype}"
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"[{dims}] {self.dtype}"


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed (graph inputs that are not initializers)."""
    initializers = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type") or tensor_type.elem_type == TensorProto.UNDEFINED:
            raise QtoolError(f"model input '{value.name}' is not a tensor of a known type; qtool can only feed tensors")
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        except (KeyError, TypeError) as e:
            name = TensorProto.DataType.Name(tensor_type.elem_type)
            raise QtoolError(f"model input '{value.name}' has type {name}, which numpy samples cannot hold") from e
        if not tensor_type.HasField("shape"):
            specs.append(InputSpec(value.name, dtype, None))
            continue
        dims: list[Dim] = []
        for d in tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            else:
                dims.append(d.dim_param or None)
        specs.append(InputSpec(value.name, dtype, tuple(dims)))
    return specs
