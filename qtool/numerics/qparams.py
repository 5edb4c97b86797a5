"""Pure numpy quantization math: range + scheme -> scale / zero point, and back.

Nothing here knows about ONNX graphs or observers. The numerics follow the ONNX
QuantizeLinear / DequantizeLinear definitions: ``q = saturate(rint(x / scale) + zp)``
with round-half-to-even in float32, and ``x = (q - zp) * scale``. For the float8
types ``x / scale`` (in float32) is rounded to the nearest float8 value, ties to even,
and saturates at the type's largest finite value; their zero point is always 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
from onnx import TensorProto

from qtool.errors import QtoolError


@dataclass(frozen=True)
class QuantType:
    """A storage type: its name, ONNX element type and numeric range.

    An integer type holds the integers ``qmin..qmax``. A float8 type (``float8``) holds the
    values of its 8-bit float grid, ``qmax`` being the largest finite one (448 for E4M3FN,
    57344 for E5M2): a scale maps the range onto it and values round to that grid.
    """

    name: str
    onnx_type: int
    numpy_dtype: type[np.generic]  # the dtype values are computed in (4- and 2-bit ones are packed on storage)
    qmin: int
    qmax: int
    reduced: bool = False  # one bit of the range left unused (see :meth:`reduced_range`)
    float8: bool = False  # values on a float8 grid (symmetric only: zero point 0), not integers

    @property
    def signed(self) -> bool:
        return self.qmin < 0

    @property
    def bits(self) -> int:
        """Bits per stored value (a reduced range still stores ``bits`` bits)."""
        if self.float8:
            return 8
        return int(self.qmax - self.qmin).bit_length() + int(self.reduced)

    def reduced_range(self) -> QuantType:
        """The same storage with half the range: int8 values in [-64, 63], as onnxruntime's ``reduce_range``.

        x86 CPUs without VNNI multiply uint8 activations by int8 weights with VPMADDUBSW, which adds
        two products in int16 and saturates: 255 x 127 x 2 overflows, 255 x 64 x 2 does not.
        """
        if self.reduced:
            return self
        return QuantType(self.name, self.onnx_type, self.numpy_dtype, self.qmin // 2, (self.qmax + 1) // 2 - 1, True)


QUANT_TYPES: dict[str, QuantType] = {
    "int8": QuantType("int8", TensorProto.INT8, np.int8, -128, 127),
    "uint8": QuantType("uint8", TensorProto.UINT8, np.uint8, 0, 255),
    "int16": QuantType("int16", TensorProto.INT16, np.int16, -32768, 32767),
    "uint16": QuantType("uint16", TensorProto.UINT16, np.uint16, 0, 65535),
    "int4": QuantType("int4", TensorProto.INT4, np.int8, -8, 7),
    "uint4": QuantType("uint4", TensorProto.UINT4, np.uint8, 0, 15),
    "int2": QuantType("int2", TensorProto.INT2, np.int8, -2, 1),
    "uint2": QuantType("uint2", TensorProto.UINT2, np.uint8, 0, 3),
    "fp8_e4m3": QuantType("fp8_e4m3", TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, -448, 448, float8=True),
    "fp8_e5m2": QuantType("fp8_e5m2", TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2, -57344, 57344, float8=True),
}

_INT32 = np.iinfo(np.int32)
# Element-wise work on a large weight goes this many elements at a time: its float and int64
# temporaries then cost a few of these chunks, not several times the weight (a 500 MB embedding).
CHUNK_ELEMENTS = 1 << 20


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
    """Scale and zero point for one tensor.

    Per tensor: scalars. Per channel: 1-D along ``axis``. Per block: the
    tensor's shape with ``axis`` divided (rounded up) by ``block_size``, as
    opset-21 DequantizeLinear takes them.
    """

    scale: np.ndarray  # float32
    zero_point: np.ndarray  # qtype's dtype, same shape as scale
    qtype: QuantType
    axis: int | None = None
    block_size: int | None = None
    narrow: bool = False  # signed symmetric narrow range: values clip at -qmax, not qmin

    @property
    def qmin(self) -> int:
        return -self.qtype.qmax if self.narrow else self.qtype.qmin

    def expand(self, values: np.ndarray, ndim: int, length: int) -> np.ndarray:
        """``values`` (scale or zero point) broadcastable against a tensor of rank ``ndim``."""
        if self.axis is None:
            return values
        if self.block_size is not None:
            return np.repeat(values, self.block_size, axis=self.axis).take(range(length), axis=self.axis)
        shape = [1] * ndim
        shape[self.axis] = values.size
        return values.reshape(shape)


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
    centre the zero point. Float8 types are symmetric only: ``scale = absmax / qmax``
    (448 for E4M3FN) and a zero point 0 of the float8 type.

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

    Raises:
        QtoolError: the range is not finite, or an asymmetric range was asked of a float8 type.
    """
    if qtype.float8 and not symmetric:
        raise QtoolError(
            f"{what}: {qtype.name} is quantized symmetrically only (its zero point is 0)", hint="set symmetric: true"
        )
    lo = np.minimum(np.asarray(rmin, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(rmax, dtype=np.float64), 0.0)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise QtoolError(
            f"{what}: observed range is not finite (min={np.min(lo)}, max={np.max(hi)})",
            hint="the float model produces inf/NaN on the calibration data; check the data or keep this node in float",
        )
    scale32, zero = _scale_and_zero(lo, hi, qtype, symmetric=symmetric, narrow_range=narrow_range)
    return QParams(
        scale=scale32,
        zero_point=zero.astype(qtype.numpy_dtype),
        qtype=qtype,
        axis=axis,
        narrow=bool(symmetric and narrow_range and qtype.signed and not qtype.float8),
    )


def within_ceiling(qp: QParams, ceiling: float) -> QParams:
    """``qp`` with its scale lowered by the ulps that keep its largest value within ``ceiling``.

    onnxruntime drops a Clip before a QuantizeLinear only when the quantizer's largest value,
    ``scale * (qmax - zero_point)`` in float32, passes the Clip's upper bound by at most float32's epsilon. A
    range that reaches the bound ``c`` gives ``scale = c/255``, and for about one ``c`` in 700 (7.98, say; not 6)
    that product rounds up past ``c`` by an ulp, more than epsilon: then the scale is lowered (per tensor only).
    """
    if qp.axis is not None or qp.qtype.float8:
        return qp
    steps = np.float32(qp.qtype.qmax - int(qp.zero_point))
    scale, limit = np.float32(qp.scale), np.float32(ceiling) + np.finfo(np.float32).eps
    if steps <= 0 or np.float32(scale * steps) <= limit:
        return qp
    scale = min(scale, np.float32(ceiling / float(steps)))
    while scale > 0 and np.float32(scale * steps) > limit:  # a few ulps at most
        scale = np.nextafter(scale, np.float32(0))
    return replace(qp, scale=np.asarray(scale, dtype=np.float32))


def _scale_and_zero(
    lo: np.ndarray, hi: np.ndarray, qtype: QuantType, *, symmetric: bool, narrow_range: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scale and the zero point (float64, on the grid) of a range that includes 0."""
    qmin, qmax = qtype.qmin, qtype.qmax
    zero: np.ndarray | None
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
    return scale32, zero


def _expanded(qp: QParams, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    length = x.shape[qp.axis] if qp.axis is not None else 0
    return qp.expand(qp.scale, x.ndim, length), qp.expand(qp.zero_point.astype(np.int64), x.ndim, length)


def quantize(x: np.ndarray, qp: QParams) -> np.ndarray:
    """QuantizeLinear: float32 tensor -> integers (or float8 values) of ``qp.qtype``.

    A large tensor is quantized in slices along an axis its qparams do not vary along per element
    (the same values: each element's rounding depends on its own scale and zero point only).
    """
    if x.ndim < 2 or x.size <= CHUNK_ELEMENTS:
        return _quantize(x, qp)
    along = 1 if qp.axis is not None and qp.axis % x.ndim == 0 else 0
    step = max(1, CHUNK_ELEMENTS // (x.size // x.shape[along]))
    out = np.empty(x.shape, qp.qtype.numpy_dtype)
    for start in range(0, x.shape[along], step):
        part = (slice(None),) * along + (slice(start, start + step),)
        out[part] = _quantize(x[part], _sliced(qp, part))
    return out


def _sliced(qp: QParams, part: tuple[slice, ...]) -> QParams:
    """``qp`` for the slice ``part`` of its tensor: block-wise qparams have the tensor's other dims."""
    if qp.block_size is None or qp.axis is None:
        return qp  # per tensor, or per channel along an axis the slice keeps whole
    return replace(qp, scale=qp.scale[part], zero_point=qp.zero_point[part])


def _quantize(x: np.ndarray, qp: QParams) -> np.ndarray:
    scale, zero = _expanded(qp, x)
    if qp.qtype.float8:
        # Saturated before the cast (QuantizeLinear's saturate=1): the cast would make E4M3FN values
        # beyond 464 NaN and E5M2 ones inf. NaN stays NaN, as in onnxruntime.
        scaled = np.clip(x.astype(np.float32) / scale.astype(np.float32), -qp.qtype.qmax, qp.qtype.qmax)
        return scaled.astype(np.float32).astype(qp.qtype.numpy_dtype)
    # Clipped in float first: +-inf and values beyond int64 would wrap around in the integer cast.
    steps = np.clip(np.rint(x.astype(np.float32) / scale), qp.qmin - zero, qp.qtype.qmax - zero)
    q = steps.astype(np.int64) + zero
    return np.clip(q, qp.qmin, qp.qtype.qmax).astype(qp.qtype.numpy_dtype)


def dequantize(q: np.ndarray, qp: QParams) -> np.ndarray:
    """DequantizeLinear: integers (or float8 values) -> float32."""
    scale, zero = _expanded(qp, q)
    if qp.qtype.float8:  # zero point 0
        return (q.astype(np.float32) * scale).astype(np.float32)
    return ((q.astype(np.int64) - zero).astype(np.float32) * scale).astype(np.float32)


def weight_range(weight: np.ndarray, axis: int | None, block_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of a weight: whole tensor, per slice along ``axis``, or per block of ``axis``.

    Per block, the result has the weight's shape with ``axis`` divided by
    ``block_size`` (rounded up; the last block may be shorter).
    """
    if axis is None:
        return np.asarray(weight.min()), np.asarray(weight.max())
    if block_size is None:
        reduce_axes = tuple(i for i in range(weight.ndim) if i != axis)
        return weight.min(axis=reduce_axes), weight.max(axis=reduce_axes)
    starts = np.arange(0, weight.shape[axis], block_size)
    return np.minimum.reduceat(weight, starts, axis=axis), np.maximum.reduceat(weight, starts, axis=axis)


def to_tensor_proto(values: np.ndarray, qtype: QuantType, name: str) -> TensorProto:
    """An initializer of ``qtype`` holding integer ``values``; 4- and 2-bit types are packed.

    Packing follows the ONNX spec: the first element in the lowest bits of each
    byte, the last byte padded with zeros.
    """
    bits = qtype.bits
    if bits >= 8:
        from onnx import numpy_helper

        return numpy_helper.from_array(values.astype(qtype.numpy_dtype), name)
    per_byte = 8 // bits
    flat = (values.astype(np.int64).ravel() & ((1 << bits) - 1)).astype(np.uint8)
    flat = np.concatenate([flat, np.zeros((-flat.size) % per_byte, np.uint8)]).reshape(-1, per_byte)
    packed = np.zeros(flat.shape[0], np.uint8)
    for position in range(per_byte):
        packed |= flat[:, position] << np.uint8(bits * position)
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = qtype.onnx_type
    tensor.dims.extend(values.shape)
    tensor.raw_data = packed.tobytes()
    return tensor


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
