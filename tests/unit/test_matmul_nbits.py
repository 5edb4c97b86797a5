from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qtool.errors import QtoolError
from qtool.quantization.algorithms.gptq import gptq_round, weight_rows
from qtool.quantization.matmul_nbits import (
    DOMAIN,
    NBitsScheme,
    NBitsWeight,
    dequantize,
    grid_of,
    make_matmul_nbits,
    pack_codes,
    quantize_rtn,
    rtn_grid,
    unpack_codes,
)

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


def _assert_matches_reference(weight: NBitsWeight, a: np.ndarray) -> None:
    b = dequantize(weight).astype(np.float64)
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
        w, a = _layer(k, n, seed=k + n + bits)
        packed = quantize_rtn(w, NBitsScheme(bits, block_size, symmetric), accuracy_level=accuracy_level)
        blocks = -(-k // block_size)
        assert packed.packed.shape == (n, blocks, block_size * bits // 8)
        assert packed.packed.dtype == np.uint8 and packed.scales.dtype == np.float32
        assert packed.scales.shape == (n, blocks)
        if symmetric:
            assert packed.zero_points is None
        else:
            assert packed.zero_points is not None and packed.zero_points.dtype == np.uint8
            assert packed.zero_points.shape == (n, -(-blocks * bits // 8))
        _assert_matches_reference(packed, a)


def test_the_reference_would_catch_a_wrong_layout():
    """The check above fails for a weight whose codes are transposed within the blocks."""
    w, a = _layer(64, 16, seed=3)
    packed = quantize_rtn(w, NBitsScheme(4, 32))
    codes = unpack_codes(packed)
    shuffled = codes.reshape(2, 32, 16)[:, ::-1].reshape(64, 16)  # each block's rows reversed
    wrong = pack_codes(shuffled, grid_of(packed).scales, None, 4, 32)
    b_wrong, b = dequantize(wrong), dequantize(packed)
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
    np.testing.assert_array_equal(unpack_codes(packed), codes)
    grid = grid_of(packed)
    np.testing.assert_array_equal(grid.scales, scales)
    expected_zero = np.full((blocks, n), 1 << (bits - 1)) if zero is None else zero
    np.testing.assert_array_equal(grid.zero_points, expected_zero)
    # The first element of a block sits in the lowest bits of the first byte.
    assert packed.packed[0, 0, 0] & ((1 << bits) - 1) == codes[0, 0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_rtn_error_is_at_most_half_a_step(bits, block_size):
    w = np.random.default_rng(bits * block_size).standard_t(df=3, size=(300, 40)).astype(np.float32)
    for symmetric in (True, False):
        packed = quantize_rtn(w, NBitsScheme(bits, block_size, symmetric))
        grid = grid_of(packed)
        scale, zero = grid.expand(300)
        error = np.abs(dequantize(packed) - w)
        # In range: the value's step count lies on the grid; those round to the nearest code.
        steps = w / scale
        in_range = (steps + zero >= -0.5) & (steps + zero <= grid.scheme.qmax + 0.5)
        assert np.all(error[in_range] <= np.abs(scale[in_range]) / 2 * (1 + 1e-5))
        # Out of range (only the symmetric full-range scale clips: opposite-sign values near the
        # extreme) they clip to the last code, at most one step away.
        assert np.all(error[~in_range] <= np.abs(scale[~in_range]) * (1 + 1e-5))
        if not symmetric:
            assert in_range.all()
        # The steps are as fine as the block's range allows: amax / 7 or finer symmetric, range / 15 asymmetric.
        amax = np.abs(np.pad(w, ((0, -300 % block_size), (0, 0))).reshape(-1, block_size, 40)).max(axis=1)
        widest = amax / ((1 << (bits - 1)) - 1) if symmetric else 2 * amax / ((1 << bits) - 1)
        assert np.all(np.abs(grid.scales) <= widest * (1 + 1e-6))


def test_symmetric_grid_picks_the_lower_error_scale():
    """A block whose extreme is +8 gets scale -1 (extreme on code 0); one of +-7 gets scale 1."""
    w = np.zeros((32, 2), np.float32)
    w[:16, 0] = np.arange(-7, 9)  # -7..8: the -8 step of a scale -1 grid lands exactly on 8
    w[:15, 1] = np.arange(-7, 8)  # -7..7: a scale of 1 represents every value
    w[15, 1] = 0.0
    grid = rtn_grid(w, NBitsScheme(4, 32))
    np.testing.assert_array_equal(grid.scales, [[-1.0, 1.0]])
    np.testing.assert_array_equal(dequantize(quantize_rtn(w, NBitsScheme(4, 32))), w)


def test_all_zero_blocks_and_exact_zeros():
    w = np.zeros((48, 3), np.float32)
    w[:, 1] = np.linspace(-1, 2, 48)
    for symmetric in (True, False):
        packed = quantize_rtn(w, NBitsScheme(4, 16, symmetric))
        b = dequantize(packed)
        np.testing.assert_array_equal(b[:, [0, 2]], 0.0)
        assert np.all(np.isfinite(packed.scales)) and np.all(packed.scales != 0)


def test_gptq_codes_pack_and_run_in_onnxruntime():
    """GPTQ on the [N, K] row layout with per-block scales: MatMulNBits reproduces its dequantized weight."""
    k, n, block = 96, 12, 32
    rng = np.random.default_rng(7)
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = rng.normal(size=(512, k)) @ rng.normal(size=(k, k))  # correlated inputs, so GPTQ moves codes
    hessian = x.T @ x / len(x)
    for symmetric in (True, False):
        scheme = NBitsScheme(4, block, symmetric)
        grid = rtn_grid(w, scheme)
        rows = weight_rows(w, "MatMul")  # [N, K]
        result = gptq_round(rows, hessian, grid.scales.T, grid.zero_points.T, 0, scheme.qmax, block_size=block)
        codes = result.codes.T  # back to [K, N]
        nearest = quantize_rtn(w, scheme)  # the same grid
        assert np.any(codes != unpack_codes(nearest))  # GPTQ chose other codes
        packed = pack_codes(codes, grid.scales, None if symmetric else grid.zero_points, 4, block)
        np.testing.assert_array_equal(unpack_codes(packed), codes)
        scale, zero = grid.expand(k)
        gptq_weight = ((codes - zero) * scale).astype(np.float32)
        np.testing.assert_array_equal(dequantize(packed), gptq_weight)
        a = x[:ROWS].astype(np.float32)
        np.testing.assert_allclose(_run(packed, a), a @ gptq_weight, rtol=1e-5, atol=1e-4)
        # ... and lowers the output error on the inputs it saw.
        gptq_error = np.sum((x @ (gptq_weight - w)) ** 2)
        nearest_error = np.sum((x @ (dequantize(nearest) - w)) ** 2)
        assert gptq_error < 0.9 * nearest_error


def test_node_attributes_and_names():
    w, _ = _layer(64, 8, seed=0)
    plain = make_matmul_nbits(quantize_rtn(w, NBitsScheme(4, 32)), "x", "y", prefix="fc")
    assert plain.node.domain == DOMAIN and plain.node.op_type == "MatMulNBits"
    assert {a.name: helper.get_attribute_value(a) for a in plain.node.attribute} == {
        "K": 64,
        "N": 8,
        "bits": 4,
        "block_size": 32,
    }
    assert list(plain.node.input) == ["x", "fc_Q4", "fc_scales"]
    level4 = make_matmul_nbits(quantize_rtn(w, NBitsScheme(8, 16, False), accuracy_level=4), "x", "y", prefix="fc")
    assert list(level4.node.input) == ["x", "fc_Q8", "fc_scales", "fc_zero_points"]
    assert {a.name: helper.get_attribute_value(a) for a in level4.node.attribute}["accuracy_level"] == 4


@pytest.mark.parametrize(
    ("bits", "block_size", "match"),
    [(4, 8, "block_size 8 is"), (4, 48, "block_size 48 is"), (3, 32, "3-bit"), (2, 512, "block_size 512 is")],
)
def test_layouts_onnxruntime_refuses_are_refused(bits, block_size, match):
    with pytest.raises(QtoolError, match=match):
        NBitsScheme(bits, block_size)
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
    with pytest.raises(QtoolError, match="inf or NaN"):
        quantize_rtn(np.full((32, 3), np.nan, np.float32), NBitsScheme())
