"""Activation qparams under each range rule: the observer's (clipped) range, or the observed min/max."""

from __future__ import annotations

import numpy as np

from qtool.observers import create_observer
from qtool.quantization.plan.activations import OBSERVED_EXTREMES, OBSERVER_RANGES, plan_activation_qparams
from qtool.quantization.plan.records import QuantPlan
from qtool.schemes import TensorScheme


def _observer(values: np.ndarray, name: str = "mse"):
    observer = create_observer(name, None, {})
    observer.observe(values)
    return observer


def test_extremes_take_the_observed_min_max_where_the_observer_clips_and_a_nodes_own_observer_is_kept():
    rng = np.random.default_rng(0)
    values = rng.standard_t(3, 100_000).astype(np.float32)  # heavy tails: mse clips them
    default = TensorScheme("uint8", "per_tensor", False)
    own = TensorScheme("uint8", "per_tensor", False, observer="mse")
    plan = QuantPlan((), {"a": default, "b": own, "c": default}, shared={"c": "a"})
    observers = {"a": _observer(values), "b": _observer(values), "c": _observer(values)}
    clipped = plan_activation_qparams(plan, observers, OBSERVER_RANGES)
    unclipped = plan_activation_qparams(plan, observers, OBSERVED_EXTREMES)
    full = float(values.max() - values.min())
    assert float(clipped["a"].scale) * 255 < 0.9 * full  # mse clips the tails
    assert abs(float(unclipped["a"].scale) * 255 - full) < 1e-3 * full  # the min/max keeps them
    assert unclipped["b"] == clipped["b"]  # a node's own observer is taken at its word
    assert unclipped["c"] is unclipped["a"]  # a pass-through output shares its input's qparams
