"""CI gates: thresholds on the measured numbers, each with a verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qtool.errors import QtoolError

# metric -> direction: "under" gates fail when the value is below the threshold, "over" when above
FAIL_UNDER = {
    "sqnr": "SQNR dB",
    "cosine": "cosine",
    "top1": "top-1 agreement",
    "top5": "top-5 agreement",
    "box_iou": "mean box IoU",
    "compression": "compression ratio",
}
FAIL_OVER = {"mse": "MSE", "max_abs_error": "max abs error", "latency_ratio": "latency ratio (candidate/reference)"}


@dataclass(frozen=True)
class Gate:
    """One threshold: ``metric`` must not be under (or over) ``threshold``."""

    metric: str
    direction: str  # "under" or "over"
    threshold: float

    @property
    def label(self) -> str:
        symbol = ">=" if self.direction == "under" else "<="
        return f"{self.metric} {symbol} {self.threshold:g}"


@dataclass(frozen=True)
class GateResult:
    """A gate, what was measured, and whether it passed."""

    gate: Gate
    measured: float | None  # None when the metric was not measured (e.g. top1 without classification)
    passed: bool
    note: str = ""


def _number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise QtoolError(f"{option}: '{text}' is not a number") from None
    if math.isnan(value):
        raise QtoolError(f"{option}: NaN is not a threshold")
    return value


def parse_gates(
    fail_under: list[str] | None = None,
    fail_over: list[str] | None = None,
    min_compression: float | None = None,
    max_latency_ratio: float | None = None,
) -> list[Gate]:
    """Build gates from ``--fail-under metric=value`` / ``--fail-over metric=value`` and the two shortcuts.

    Raises:
        QtoolError: a malformed gate or an unknown metric (a usage error, exit 2).
    """
    gates: list[Gate] = []
    for option, specs, allowed, direction in (
        ("--fail-under", fail_under, FAIL_UNDER, "under"),
        ("--fail-over", fail_over, FAIL_OVER, "over"),
    ):
        for spec in specs or []:
            metric, sep, value = spec.partition("=")
            metric = metric.strip().lower()
            if not sep:
                raise QtoolError(f"{option} expects METRIC=VALUE, got '{spec}'")
            if metric not in allowed:
                raise QtoolError(f"{option}: unknown metric '{metric}'", hint=f"use one of: {', '.join(allowed)}")
            gates.append(Gate(metric, direction, _number(value, option)))
    if min_compression is not None:
        gates.append(Gate("compression", "under", min_compression))
    if max_latency_ratio is not None:
        gates.append(Gate("latency_ratio", "over", max_latency_ratio))
    return gates


def evaluate_gates(gates: list[Gate], measured: dict[str, float | None]) -> list[GateResult]:
    """Judge every gate against the measured values (a missing value fails, with a note)."""
    results = []
    for gate in gates:
        value = measured.get(gate.metric)
        if value is None:
            results.append(GateResult(gate, None, False, "not measured"))
            continue
        passed = value >= gate.threshold if gate.direction == "under" else value <= gate.threshold
        results.append(GateResult(gate, value, passed))
    return results
