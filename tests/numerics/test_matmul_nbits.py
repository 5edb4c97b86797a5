from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qtool.errors import QtoolError
from qtool.numerics.matmul_nbits import (
    DOMAIN,
    NBitsWeight,
    check_layout,
    make_matmul_nbits,
    pack_codes,
)
from qtool.numerics.ranges import weight_qparams
from qtool.quantization.algorithms.rounding.gptq import RowGrid, gptq_round, round_nearest, weight_rows
from qtool.schemes import TensorScheme

ROWS = 5  # rows of A


def _model(weight: NBitsWeight) -> onnx.ModelProto:
    parts = make_matmul_nbits(weight, "A", "Y", prefix="W")
    graph = helper.make_graph(
        [parts.node],
        "nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [ROWS, weight.k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [ROWS, weight.n])],
        list(parts.initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    onnx.checker.check_model(model)
    return model


def _run(weight: NBitsWeight, a: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(_model(weight).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


def _layer(k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight [K, N] and inputs [ROWS, K] whose channels differ in size, as real activations do."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(size=(k, n)).astype(np.float32)
    a = (rng.normal(size=(ROWS, k)) * np.exp(rng.normal(size=k))).astype(np.float32)
    return weight, a


def _codes(k: int, n: int, bits: int, block_size: int, symmetric: bool, seed: int):
    """Random codes [K, N], scales [n_blocks, N] (negative ones too) and zero points (None: symmetric)."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block_size)
    codes = rng.integers(0, 1 << bits, size=(k, n))
    scales = rng.uniform(-0.1, 0.1, size=(blocks, n)).astype(np.float32)
    zero = None if symmetric else rng.integers(0, 1 << bits, size=(blocks, n))
    return codes, scales, zero


def _reference(
    codes: np.ndarray, scales: np.ndarray, zero: np.ndarray | None, bits: int, block_size: int
) -> np.ndarray:
    """``(code - zero_point) * scale`` per block of K: what MatMulNBits multiplies by, float32 [K, N]."""
    k = codes.shape[0]
    zero = np.full(scales.shape, 1 << (bits - 1)) if zero is None else zero
    scale_k, zero_k = (np.repeat(v, block_size, axis=0)[:k] for v in (scales, zero))
    return ((codes - zero_k).astype(np.float32) * scale_k).astype(np.float32)


def _assert_matches_reference(weight: NBitsWeight, a: np.ndarray, b: np.ndarray) -> None:
    b = b.astype(np.float64)
    expected = a.astype(np.float64) @ b
    got = _run(weight, a).astype(np.float64)
    magnitude = np.abs(a).astype(np.float64) @ np.abs(b)  # bounds every partial sum of the product
    if weight.accuracy_level == 4:
        # The CPU kernel quantizes A to int8 (symmetric, per block of K or per row): each value
        # moves by at most half a step, amax / 254, so the output moves by at most that times
        # sum |B|. The row's amax bounds any finer block's; measured at 0.14-0.15 of this bound.
        row_amax = np.abs(a).max(axis=1, keepdims=True).astype(np.float64)
        tolerance = row_amax / 254 * np.abs(b).sum(axis=0) + 1e-5 * magnitude
    else:
        tolerance = 1e-5 * magnitude  # float32 accumulation in another order
    np.testing.assert_array_less(np.abs(got - expected), tolerance + 1e-30)


@pytest.mark.parametrize("bits", [4, 8, 2])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_onnxruntime_computes_a_times_the_dequantized_weight(bits, block_size, symmetric, accuracy_level):
    for k, n in ((64, 8), (100, 24), (300, 17)):  # 100 and 300: the last block is padded
        _, a = _layer(k, n, seed=k + n + bits)
        codes, scales, zero = _codes(k, n, bits, block_size, symmetric, seed=k + n + bits)
        packed = pack_codes(codes, scales, zero, bits, block_size, accuracy_level=accuracy_level)
        blocks = -(-k // block_size)
        assert packed.packed.shape == (n, blocks, block_size * bits // 8)
        assert packed.packed.dtype == np.uint8 and packed.scales.dtype == np.float32
        assert packed.scales.shape == (n, blocks)
        if symmetric:
            assert packed.zero_points is None
        else:
            assert packed.zero_points is not None and packed.zero_points.dtype == np.uint8
            assert packed.zero_points.shape == (n, -(-blocks * bits // 8))
        _assert_matches_reference(packed, a, _reference(codes, scales, zero, bits, block_size))


def test_the_reference_would_catch_a_wrong_layout():
    """The check above fails for a weight whose codes are transposed within the blocks."""
    _, a = _layer(64, 16, seed=3)
    codes, scales, _ = _codes(64, 16, 4, 32, True, seed=3)
    shuffled = codes.reshape(2, 32, 16)[:, ::-1].reshape(64, 16)  # each block's rows reversed
    wrong = pack_codes(shuffled, scales, None, 4, 32)
    b_wrong, b = _reference(shuffled, scales, None, 4, 32), _reference(codes, scales, None, 4, 32)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(_run(wrong, a), a @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_run(wrong, a), a @ b_wrong, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_and_unpack_round_trip(bits, symmetric):
    rng = np.random.default_rng(bits)
    k, n, block = 77, 9, 16
    blocks = -(-k // block)
    codes = rng.integers(0, 1 << bits, size=(k, n))
    scales = rng.uniform(-1, 1, size=(blocks, n)).astype(np.float32)
    zero = rng.integers(0, 1 << bits, size=(blocks, n)) if not symmetric else None
    packed = pack_codes(codes, scales, zero, bits, block)
    np.testing.assert_array_equal(packed.scales, scales.T)
    assert (packed.zero_points is None) == symmetric
    # The first element of a block sits in the lowest bits of the first byte.
    assert packed.packed[0, 0, 0] & ((1 << bits) - 1) == codes[0, 0]


def test_gptq_codes_pack_and_run_in_onnxruntime():
    """GPTQ on the [N, K] row layout with per-block scales: MatMulNBits reproduces its dequantized weight."""
    k, n, block = 96, 12, 32
    rng = np.random.default_rng(7)
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = rng.normal(size=(512, k)) @ rng.normal(size=(k, k))  # correlated inputs, so GPTQ moves codes
    hessian = x.T @ x / len(x)
    for symmetric in (True, False):
        # the grid the product stores int4/uint4 per-block weights on, shifted into MatMulNBits' unsigned codes
        qp = weight_qparams(
            w, TensorScheme("int4" if symmetric else "uint4", "per_block", symmetric, block), 0, "w", block
        )
        offset = 8 if qp.qtype.signed else 0
        scales, zero = qp.scale.astype(np.float32), qp.zero_point.astype(np.int64) + offset
        rows = weight_rows(w, "MatMul")  # [N, K]
        result = gptq_round(rows, hessian, RowGrid(scales.T, zero.T, 0, 15, block_size=block))
        codes = result.codes.T  # back to [K, N]
        scale_k, zero_k = (np.repeat(v, block, axis=0)[:k] for v in (scales, zero))
        nearest_codes = round_nearest(w, scale_k, zero_k, 0, 15)
        assert np.any(codes != nearest_codes)  # GPTQ chose other codes
        packed = pack_codes(codes, scales, None if symmetric else zero, 4, block)
        gptq_weight = _reference(codes, scales, None if symmetric else zero, 4, block)
        a = x[:ROWS].astype(np.float32)
        np.testing.assert_allclose(_run(packed, a), a @ gptq_weight, rtol=1e-5, atol=1e-4)
        # ... and lowers the output error on the inputs it saw.
        gptq_error = np.sum((x @ (gptq_weight - w)) ** 2)
        nearest_error = np.sum(
            (x @ (_reference(nearest_codes, scales, None if symmetric else zero, 4, block) - w)) ** 2
        )
        assert gptq_error < 0.9 * nearest_error


def test_node_attributes_and_names():
    codes, scales, _ = _codes(64, 8, 4, 32, True, seed=0)
    plain = make_matmul_nbits(pack_codes(codes, scales, None, 4, 32), "x", "y", prefix="fc")
    assert plain.node.domain == DOMAIN and plain.node.op_type == "MatMulNBits"
    assert {a.name: helper.get_attribute_value(a) for a in plain.node.attribute} == {
        "K": 64,
        "N": 8,
        "bits": 4,
        "block_size": 32,
    }
    assert list(plain.node.input) == ["x", "fc_Q4", "fc_scales"]
    codes, scales, zero = _codes(64, 8, 8, 16, False, seed=0)
    level4 = make_matmul_nbits(pack_codes(codes, scales, zero, 8, 16, accuracy_level=4), "x", "y", prefix="fc")
    assert list(level4.node.input) == ["x", "fc_Q8", "fc_scales", "fc_zero_points"]
    assert {a.name: helper.get_attribute_value(a) for a in level4.node.attribute}["accuracy_level"] == 4


@pytest.mark.parametrize(
    ("bits", "block_size", "match"),
    [(4, 8, "block_size 8 is"), (4, 48, "block_size 48 is"), (3, 32, "3-bit"), (2, 512, "block_size 512 is")],
)
def test_layouts_onnxruntime_refuses_are_refused(bits, block_size, match):
    with pytest.raises(QtoolError, match=match):
        check_layout(bits, block_size)
    with pytest.raises(QtoolError, match=match):
        pack_codes(np.zeros((32, 2), int), np.ones((1, 2), np.float32), None, bits, block_size)


def test_bad_codes_scales_and_zero_points_are_refused():
    ones = np.ones((2, 3), np.float32)
    with pytest.raises(QtoolError, match=r"0\.\.15"):
        pack_codes(np.full((32, 3), 16), ones, None, 4, 16)
    with pytest.raises(QtoolError, match="signed codes"):
        pack_codes(np.full((32, 3), -1), ones, None, 4, 16)
    with pytest.raises(QtoolError, match="scales of shape"):
        pack_codes(np.zeros((32, 3), int), ones.T, None, 4, 16)
    with pytest.raises(QtoolError, match="zero points"):
        pack_codes(np.zeros((32, 3), int), ones, np.full((2, 3), 16), 4, 16)
    with pytest.raises(QtoolError, match="accuracy_level"):
        pack_codes(np.zeros((32, 3), int), ones, None, 4, 16, accuracy_level=5)
    with pytest.raises(QtoolError, match="integers"):
        pack_codes(np.zeros((32, 3)), ones, None, 4, 16)
