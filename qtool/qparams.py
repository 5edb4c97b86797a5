"""Pure numpy quantization math: range + scheme -> scale / zero point, and back.

Nothing here knows about ONNX graphs or observers. The numerics follow the ONNX
QuantizeLinear / DequantizeLinear definitions: ``q = saturate(rint(x / scale) + zp)``
with round-half-to-even in float32, and ``x = (q - zp) * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from qtool.errors import QtoolError


@dataclass(frozen=True)
class QuantType:
    """An integer storage type: its name, ONNX element type and numeric range."""

    name: str
    onnx_type: int
    numpy_dtype: type[np.generic]
    qmin: int
    qmax: int

    @property
    def signed(self) -> bool:
        return self.qmin < 0


QUANT_TYPES: dict[str, QuantType] = {
    "int8": QuantType("int8", TensorProto.INT8, np.int8, -128, 127),
    "uint8": QuantType("uint8", TensorProto.UINT8, np.uint8, 0, 255),
    "int16": QuantType("int16", TensorProto.INT16, np.int16, -32768, 32767),
    "uint16": QuantType("uint16", TensorProto.UINT16, np.uint16, 0, 65535),
}

_INT32 = np.iinfo(np.int32)


def quant_type(name: str) -> QuantType:
    """Look up a storage type by name, with an error that lists the valid ones."""
    try:
        return QUANT_TYPES[name]
    except KeyError:
        raise QtoolError(
            f"unsupported quantization dtype '{name}'", hint=f"choose one of: {', '.join(QUANT_TYPES)}"
        ) from None


@dataclass(frozen=True)
class QParams:
    """Scale and zero point for one tensor; ``axis`` is set for per-channel parameters."""

    scale: np.ndarray  # float32, shape () or (channels,)
    zero_point: np.ndarray  # qtype's dtype, same shape as scale
    qtype: QuantType
    axis: int | None = None

    def broadcast_shape(self, ndim: int) -> tuple[int, ...]:
        """Shape that makes scale/zero point broadcast against a tensor of rank ``ndim``."""
        if self.axis is None:
            return ()
        shape = [1] * ndim
        shape[self.axis] = self.scale.size
        return tuple(shape)


def compute_qparams(
    rmin: np.ndarray | float,
    rmax: np.ndarray | float,
    qtype: QuantType,
    *,
    symmetric: bool,
    narrow_range: bool = False,
    axis: int | None = None,
    what: str = "tensor",
) -> QParams:
    """Turn an observed range into scale and zero point.

    The range is widened to include 0 so that zero is exactly representable. A
    zero-width range (an all-zero tensor) gets scale 1.0 instead of 0. Symmetric
    signed types use zero point 0 (with ``narrow_range`` the range is
    ``[-qmax, qmax]`` so that ``-x`` quantizes to ``-q``); symmetric unsigned types
    centre the zero point.

    Args:
        rmin: observed minimum, a scalar or one value per channel.
        rmax: observed maximum, same shape as ``rmin``.
        qtype: the integer type to quantize to.
        symmetric: force a zero-centred range.
        narrow_range: for signed symmetric types, drop the most negative value.
        axis: the channel axis that per-channel values belong to.
        what: the tensor's name, for error messages.

    Returns:
        QParams with float32 scale and zero point of ``qtype``.
    """
    lo = np.minimum(np.asarray(rmin, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(rmax, dtype=np.float64), 0.0)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise QtoolError(
            f"{what}: observed range is not finite (min={np.min(lo)}, max={np.max(hi)})",
            hint="the float model produces inf/NaN on the calibration data; check the data or keep this node in float",
        )
    qmin, qmax = qtype.qmin, qtype.qmax
    if symmetric:
        absmax = np.maximum(-lo, hi)
        if qtype.signed:
            if narrow_range:
                qmin = -qmax
            scale = absmax / qmax
            zero = np.zeros_like(absmax)
        else:
            half = (qmax - qmin) // 2  # 127 for uint8: [1, 255] around 128
            scale = absmax / half
            zero = np.full_like(absmax, qmin + half + 1)
    else:
        scale = (hi - lo) / (qmax - qmin)
        zero = None
    scale32 = np.where(scale > 0, scale, 1.0).astype(np.float32)
    # A positive range can still underflow float32: keep the smallest normal number.
    scale32 = np.maximum(scale32, np.finfo(np.float32).tiny)
    if zero is None:
        zero = np.clip(np.rint(qmin - lo / scale32.astype(np.float64)), qmin, qmax)
    return QParams(
        scale=scale32,
        zero_point=zero.astype(qtype.numpy_dtype),
        qtype=qtype,
        axis=axis,
    )


def quantize(x: np.ndarray, qp: QParams) -> np.ndarray:
    """QuantizeLinear: float32 tensor -> integers of ``qp.qtype``."""
    shape = qp.broadcast_shape(x.ndim)
    scale = qp.scale.reshape(shape)
    zero = qp.zero_point.astype(np.int64).reshape(shape)
    q = np.rint(x.astype(np.float32) / scale).astype(np.int64) + zero
    return np.clip(q, qp.qtype.qmin, qp.qtype.qmax).astype(qp.qtype.numpy_dtype)


def dequantize(q: np.ndarray, qp: QParams) -> np.ndarray:
    """DequantizeLinear: integers -> float32."""
    shape = qp.broadcast_shape(q.ndim)
    zero = qp.zero_point.astype(np.int64).reshape(shape)
    return ((q.astype(np.int64) - zero).astype(np.float32) * qp.scale.reshape(shape)).astype(np.float32)


def weight_range(weight: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of a weight, over the whole tensor or per slice along ``axis``."""
    if axis is None:
        return np.asarray(weight.min()), np.asarray(weight.max())
    reduce_axes = tuple(i for i in range(weight.ndim) if i != axis)
    return weight.min(axis=reduce_axes), weight.max(axis=reduce_axes)


def quantize_bias(bias: np.ndarray, input_scale: np.ndarray, weight_scale: np.ndarray) -> tuple[np.ndarray, QParams]:
    """Quantize a bias to int32 with scale = input_scale x weight_scale (per output channel).

    Returns the int32 values and their QParams (zero point 0; per-channel along
    axis 0 when the weight scale is per channel).
    """
    scale = (np.float32(input_scale) * weight_scale.astype(np.float32)).astype(np.float32)
    scale = np.maximum(scale, np.finfo(np.float32).tiny)
    q = np.rint(bias.astype(np.float64) / scale.astype(np.float64))
    q = np.clip(q, _INT32.min, _INT32.max).astype(np.int32)
    int32 = QuantType("int32", TensorProto.INT32, np.int32, int(_INT32.min), int(_INT32.max))
    axis = 0 if scale.ndim == 1 else None
    return q, QParams(scale=scale, zero_point=np.zeros(scale.shape, np.int32), qtype=int32, axis=axis)
