"""CI gates: thresholds on the measured numbers, each with a verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from qtool.errors import QtoolError
from qtool.options import DECODE_STEPS
from qtool.schemas.reports.compare import GateResult

# metric -> direction: "under" gates fail when the value is below the threshold, "over" when above
FAIL_UNDER = {
    "sqnr": "SQNR dB",
    "cosine": "cosine",
    "top1": "top-1 agreement",
    "top5": "top-5 agreement",
    "box_iou": "mean box IoU",
    "compression": "compression ratio",
    "next_token": "next-token agreement (decoders)",
    "decode_agreement": "decode-step agreement through the cache (decoders)",
    "free_running": "free-running greedy decode agreement (decoders)",
}
FAIL_OVER = {
    "mse": "MSE",
    "max_abs_error": "max abs error",
    "latency_ratio": "latency ratio (candidate/reference)",
    "ppl_ratio": "perplexity ratio (candidate/reference, decoders)",
}
LANGUAGE_MODEL_METRICS = ("next_token", "decode_agreement", "free_running", "ppl_ratio")


# The range a threshold can take, per metric: fractions are fractions (top-1 = 0.99 means 99 %).
RANGES = {
    "cosine": (-1.0, 1.0),
    "top1": (0.0, 1.0),
    "top5": (0.0, 1.0),
    "box_iou": (0.0, 1.0),
    "compression": (0.0, math.inf),
    "mse": (0.0, math.inf),
    "max_abs_error": (0.0, math.inf),
    "latency_ratio": (0.0, math.inf),
    "next_token": (0.0, 1.0),
    "decode_agreement": (0.0, 1.0),
    "free_running": (0.0, 1.0),
    "ppl_ratio": (0.0, math.inf),
}
FRACTIONS = (
    "top1",
    "top5",
    "box_iou",
    "next_token",
    "decode_agreement",
    "free_running",
)  # often written as percentages


@dataclass(frozen=True)
class Gate:
    """One threshold: ``metric`` must not be under (or over) ``threshold``.

    ``tolerance`` (latency only) widens an "over" threshold by that fraction; a latency gate fails
    only when the whole confidence interval of the measured ratio lies above threshold x (1 + tolerance).
    """

    metric: str
    direction: str  # "under" or "over"
    threshold: float
    tolerance: float = 0.0

    @property
    def allowed(self) -> float:
        return self.threshold * (1 + self.tolerance)

    @property
    def label(self) -> str:
        symbol = ">=" if self.direction == "under" else "<="
        extra = f" (+{self.tolerance:.0%} tolerance)" if self.tolerance else ""
        return f"{self.metric} {symbol} {self.threshold:g}{extra}"


def gate_result(gate: Gate, measured: float | None, passed: bool, note: str = "") -> GateResult:
    """The report's record of ``gate`` judged: what was measured (None: not measured) and whether it passed."""
    return GateResult(
        gate=gate.label,
        metric=gate.metric,
        direction=gate.direction,
        threshold=gate.threshold,
        measured=measured,
        passed=passed,
        note=note,
    )


def _number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise QtoolError(f"{option}: '{text}' is not a number") from None
    if math.isnan(value):
        raise QtoolError(f"{option}: NaN is not a threshold")
    return value


# Two sessions of one model on one CPU differ from run to run (memory placement, which core their
# threads land on): a per-run interval cannot see that, so a latency gate allows this much unless
# the user states another tolerance. On a 2-core EPYC, 100 pairs of sessions of the mlp sample
# (a 15 us model, the noisiest case) had median ratios with a spread of 1.7 % (2.4 % with the other
# core busy); none of those 200 pairs, nor of 80 compares of a byte copy, had an interval wholly
# above 1.02.
DEFAULT_LATENCY_TOLERANCE = 0.02


def parse_tolerance(text: str | None) -> float:
    """``5%`` or ``0.05`` -> 0.05 (``--latency-tolerance``); None -> the default, 2 %."""
    if text is None:
        return DEFAULT_LATENCY_TOLERANCE
    stripped = text.strip()
    value = _number(stripped.removesuffix("%"), "--latency-tolerance")
    value = value / 100 if stripped.endswith("%") else value
    if not 0 <= value <= 10:
        raise QtoolError(f"--latency-tolerance: {text} is outside 0..1000 %", hint="e.g. 5% or 0.05")
    return value


def _check_range(gate: Gate, option: str) -> None:
    low, high = RANGES.get(gate.metric, (-math.inf, math.inf))
    if low <= gate.threshold <= high:
        if gate.metric in ("compression", "latency_ratio", "ppl_ratio") and gate.threshold == 0:
            raise QtoolError(f"{option} {gate.metric}=0: a ratio gate needs a positive value")
        return
    hint = f"{gate.metric} lies in [{low:g}, {high:g}]"
    if gate.metric in FRACTIONS and 1 < gate.threshold <= 100:
        hint = f"{gate.metric} is a fraction: {gate.threshold / 100:g} means {gate.threshold:g} %"
    raise QtoolError(f"{option} {gate.metric}={gate.threshold:g} can never be measured", hint=hint)


def check_measurable(gates: list[Gate], *, runs: int, task: str, decode_steps: int = DECODE_STEPS) -> None:
    """Refuse, before any work, gates on a measurement that is switched off."""
    for gate in gates:
        if gate.metric in ("decode_agreement", "free_running") and decode_steps == 0:
            raise QtoolError(
                f"a {gate.metric} gate with --decode-steps 0: the decode loop does not run",
                hint="drop the gate or give --decode-steps N",
            )
        if gate.metric == "latency_ratio" and runs == 0:
            raise QtoolError(
                "a latency gate with --runs 0: latency is not measured", hint="drop the gate or give --runs N"
            )
        if gate.metric in ("top1", "top5") and task == "none":
            raise QtoolError(
                f"a {gate.metric} gate with --task none: agreement is not measured",
                hint="use --task auto or classification",
            )


def parse_gates(
    fail_under: list[str] | None = None,
    fail_over: list[str] | None = None,
    min_compression: float | None = None,
    max_latency_ratio: float | None = None,
    latency_tolerance: str | None = None,
) -> list[Gate]:
    """Build gates from ``--fail-under metric=value`` / ``--fail-over metric=value`` and the two shortcuts.

    Raises:
        QtoolError: a malformed gate, an unknown metric or a threshold out of the metric's range
            (a usage error, exit 2).
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
                other = "--fail-over" if option == "--fail-under" else "--fail-under"
                if metric in (FAIL_OVER if option == "--fail-under" else FAIL_UNDER):
                    better = "lower" if other == "--fail-over" else "higher"
                    raise QtoolError(f"{option}: {metric} is gated with {other} ({better} is better)")
                raise QtoolError(f"{option}: unknown metric '{metric}'", hint=f"use one of: {', '.join(allowed)}")
            gates.append(Gate(metric, direction, _number(value, option)))
            _check_range(gates[-1], option)
    if min_compression is not None:
        gates.append(Gate("compression", "under", min_compression))
        _check_range(gates[-1], "--min-compression")
    if max_latency_ratio is not None:
        gates.append(Gate("latency_ratio", "over", max_latency_ratio))
        _check_range(gates[-1], "--max-latency-ratio")
    tolerance = parse_tolerance(latency_tolerance)
    if latency_tolerance is not None and not any(g.metric == "latency_ratio" for g in gates):
        raise QtoolError("--latency-tolerance without a latency gate", hint="add --max-latency-ratio R")
    return [replace(g, tolerance=tolerance) if g.metric == "latency_ratio" else g for g in gates]


def evaluate_gates(
    gates: list[Gate],
    measured: dict[str, float | None],
    intervals: Mapping[str, Sequence[float] | None] | None = None,
) -> list[GateResult]:
    """Judge every gate against the measured values (a missing value fails, with a note).

    A metric with a confidence interval in ``intervals`` (latency) fails an "over" gate only when
    the whole interval lies above the allowed value.
    """
    results = []
    for gate in gates:
        value = measured.get(gate.metric)
        if value is None:
            results.append(gate_result(gate, None, False, "not measured"))
            continue
        interval = (intervals or {}).get(gate.metric)
        if gate.direction == "under":
            results.append(gate_result(gate, value, value >= gate.threshold))
        elif interval is not None:
            note = f"99 % interval {interval[0]:.3f}-{interval[1]:.3f}"
            results.append(gate_result(gate, value, interval[0] <= gate.allowed, note))
        else:
            results.append(gate_result(gate, value, value <= gate.allowed))
    return results
