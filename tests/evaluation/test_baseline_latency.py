"""The baseline's latency rule: drift between two runs is not a regression, a real slowdown is."""

from __future__ import annotations

import pytest

from qtool.evaluation.baseline import BASELINE_LATENCY_DRIFT, _latency_change


def _numbers(ratio: float, low: float, high: float) -> dict[str, object]:
    return {"latency_ratio": ratio, "latency_interval": (low, high), "provider": "CPUExecutionProvider"}


@pytest.mark.parametrize(
    ("then", "now"),
    [((0.668, 0.660, 0.676), (0.752, 0.738, 0.764)), ((0.633, 0.625, 0.640), (0.729, 0.720, 0.737))],
    ids=["ci-2026-11-27", "ci-2026-11-26"],
)
def test_two_runs_of_the_same_models_on_a_shared_runner_are_not_a_regression(then, now) -> None:
    change = _latency_change(_numbers(*now), _numbers(*then), tolerance=0.02)
    assert not change.regressed and change.note == "within the intervals"


def test_a_slowdown_beyond_the_drift_is_a_regression_with_its_limit() -> None:
    change = _latency_change(_numbers(0.90, 0.89, 0.91), _numbers(0.668, 0.660, 0.676), tolerance=0.02)
    assert change.regressed and change.limit == pytest.approx(0.676 * (1 + BASELINE_LATENCY_DRIFT))


def test_a_larger_latency_tolerance_widens_the_limit_further() -> None:
    change = _latency_change(_numbers(0.90, 0.89, 0.91), _numbers(0.668, 0.660, 0.676), tolerance=0.5)
    assert not change.regressed and change.limit == pytest.approx(0.676 * 1.5)
