"""Streaming error sums in float32 chunks agree with a float64 computation."""

from __future__ import annotations

import math

import numpy as np

from qtool.evaluation.metrics import ErrorAccumulator


def test_float32_chunked_sums_match_float64_on_large_tensors():
    rng = np.random.default_rng(1)
    ref = (rng.standard_normal(3_000_001) * 50 + 7).astype(np.float32)  # not a multiple of the chunk size
    cand = ref + (rng.standard_normal(ref.size) * 0.05).astype(np.float32)
    acc = ErrorAccumulator()
    acc.add(ref[:1_000_000].reshape(1000, 1000), cand[:1_000_000].reshape(1000, 1000))
    acc.add(ref[1_000_000:], cand[1_000_000:])
    m = acc.metrics("t")
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    err = r - c
    assert m.elements == ref.size
    assert math.isclose(m.sqnr_db, 10 * math.log10((r @ r) / (err @ err)), abs_tol=1e-4)
    assert math.isclose(m.cosine, (r @ c) / math.sqrt((r @ r) * (c @ c)), abs_tol=1e-6)
    assert m.max_abs_error == float(np.abs(ref - cand).max())
    assert math.isclose(m.mse, (err @ err) / ref.size, rel_tol=1e-5)


def test_other_dtypes_and_exact_matches():
    acc = ErrorAccumulator()
    values = np.arange(10, dtype=np.float16)
    acc.add(values, values)
    assert acc.metrics("t").sqnr_db == math.inf and acc.metrics("t").max_abs_error == 0.0
    acc = ErrorAccumulator()
    acc.add(np.zeros(3, np.float64), np.ones(3, np.float64))
    assert acc.metrics("t").sqnr_db == -math.inf
