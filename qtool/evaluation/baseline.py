"""The change against an earlier ``qtool compare --json`` report: what a pull request wants to see.

Each number the two reports share (compression ratio, overall SQNR, the worst top-1/top-5
agreement and box IoU, the latency ratio on the first provider) is shown as baseline, now and
change. A change is a regression when it goes the wrong way by more than its tolerance:

- compression: 1 % smaller ratio;
- SQNR: 0.1 dB lower;
- top-1, top-5, box IoU: 0.005 lower (half a percentage point);
- latency: the new ratio's 99 % interval lies wholly above the baseline's interval widened by
  :data:`BASELINE_LATENCY_DRIFT` (or the latency tolerance, ``--latency-tolerance``, when larger);
  without intervals, the medians are compared.

Two runs of the same models, minutes apart on one shared CI runner, gave latency ratios 11-15 %
apart with both 99 % intervals under 2 % wide (0.653 then 0.727, 0.633 then 0.729, 0.668 then
0.752): an interval describes the noise within one run, not the drift between runs (clock speed,
neighbours, cache state). Within a run, fp32 and the candidate are interleaved and the latency gate
keeps its 2 % tolerance; against another run's report, only a slowdown beyond that drift is a
regression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qtool.errors import QtoolError
from qtool.evaluation.gates import DEFAULT_LATENCY_TOLERANCE, Gate, gate_result
from qtool.schemas.reports import CompareReport
from qtool.schemas.reports.compare import Baseline, BaselineChange, GateResult
from qtool.system.files import read_json

REPORT_MAX_BYTES = 64 << 20
SQNR_TOLERANCE_DB = 0.1
FRACTION_TOLERANCE = 0.005
BASELINE_LATENCY_DRIFT = 0.2  # latency ratios of two runs of the same models drift this much (see the module)
COMPRESSION_TOLERANCE = 0.01


def baseline_change(
    metric: str,
    baseline: float | None,
    current: float | None,
    better: str,
    regressed: bool,
    note: str = "",
    limit: float | None = None,
) -> BaselineChange:
    """One number of the baseline report next to the same number now (``better``: "higher" or "lower").

    ``limit``: the worst value that is not a regression (the baseline and its tolerance).
    """
    difference = None
    if baseline is not None and current is not None and not (math.isinf(baseline) or math.isinf(current)):
        difference = current - baseline
    return BaselineChange(
        metric=metric,
        baseline=baseline,
        current=current,
        change=difference,
        better=better,
        regressed=regressed,
        note=note,
        limit=limit,
    )


class StaleBaselineError(QtoolError):
    """A baseline report another qtool version wrote, in a schema this one does not read."""


def read_baseline(path: Path | str) -> CompareReport:
    """A ``qtool compare --json`` report, validated; a QtoolError names the file and the field."""
    data = read_json(path, "baseline report", REPORT_MAX_BYTES)
    if not isinstance(data, dict) or "schema_version" not in data or "latency" not in data:
        raise QtoolError(f"{path} is not a 'qtool compare --json' report", hint="pass a report written by --json")
    if data.get("schema_version") != 3:
        raise StaleBaselineError(
            f"{path}: compare report schema version {data.get('schema_version')!r}, this qtool reads 3",
            hint="write the baseline again with this qtool version (in CI: accept the change once, and the "
            "default branch's next report replaces it)",
        )
    try:
        return CompareReport.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise QtoolError(f"{path}: field '{where}': {str(first['msg']).removeprefix('Value error, ')}") from None


@dataclass(frozen=True)
class Snapshot:
    """The comparable numbers of one comparison (by metric), and what it compared."""

    numbers: dict[str, Any]
    reference_sha256: str
    data: tuple[str, int]  # the data's name and sample count


def report_snapshot(report: CompareReport) -> Snapshot:
    """The comparable numbers of a report (a JSON null SQNR is an exact match: infinite)."""
    accuracy = report.accuracy
    latency = report.latency[0] if report.latency else None
    numbers = {
        "compression": report.size.compression_ratio,
        "sqnr": accuracy.overall.sqnr_db,
        "top1": min((a.top1 for a in accuracy.classification), default=None),
        "top5": min((a.top5 for a in accuracy.classification), default=None),
        "box_iou": min((b.mean_iou for b in accuracy.boxes), default=None),
        "latency_ratio": latency.latency_ratio if latency else None,
        "latency_interval": tuple(latency.latency_ratio_interval)
        if latency and latency.latency_ratio_interval
        else None,
        "provider": latency.provider if latency else None,
    }
    return Snapshot(numbers, report.models.reference.sha256, (report.data.dir, report.data.samples))


def against_baseline(
    current: Snapshot, baseline: CompareReport, path: str, latency_tolerance: float = DEFAULT_LATENCY_TOLERANCE
) -> Baseline:
    """Every number both comparisons hold, with the regressions marked (see the module docstring)."""
    earlier = report_snapshot(baseline)
    now, then = current.numbers, earlier.numbers
    changes = []
    limits = {  # metric -> the lowest value that is not a regression, from the baseline's value
        "compression": lambda b: b * (1 - COMPRESSION_TOLERANCE),
        "sqnr": lambda b: b - SQNR_TOLERANCE_DB,
        "top1": lambda b: b - FRACTION_TOLERANCE,
        "top5": lambda b: b - FRACTION_TOLERANCE,
        "box_iou": lambda b: b - FRACTION_TOLERANCE,
    }
    for metric, lowest in limits.items():
        b, c = then[metric], now[metric]
        if b is None and c is None:
            continue
        limit = lowest(b) if b is not None else None
        regressed = limit is not None and c is not None and c < limit
        changes.append(baseline_change(metric, b, c, "higher", regressed, limit=limit))
    if now["latency_ratio"] is not None or then["latency_ratio"] is not None:
        changes.append(_latency_change(now, then, latency_tolerance))
    return Baseline(
        path=path,
        same_reference=current.reference_sha256 == earlier.reference_sha256,
        same_data=current.data == earlier.data,
        regressed=any(c.regressed for c in changes),
        changes=changes,
    )


def _latency_change(now: dict[str, Any], then: dict[str, Any], tolerance: float) -> BaselineChange:
    b, c = then["latency_ratio"], now["latency_ratio"]
    if b is None or c is None:
        return baseline_change("latency_ratio", b, c, "lower", False, "measured in one report only")
    if now["provider"] != then["provider"]:
        return baseline_change("latency_ratio", b, c, "lower", False, f"{then['provider']} then, {now['provider']} now")
    low_now = now["latency_interval"][0] if now["latency_interval"] else c
    high_then = then["latency_interval"][1] if then["latency_interval"] else b
    limit = high_then * (1 + max(tolerance, BASELINE_LATENCY_DRIFT))
    regressed = low_now > limit
    note = "intervals apart" if regressed else "within the intervals"
    return baseline_change("latency_ratio", b, c, "lower", regressed, note, limit)


def regression_gates(comparison: Baseline) -> list[GateResult]:
    """Each compared number as a gate (``--fail-on-regression``): a regression fails it."""
    results = []
    for c in comparison.changes:
        if c.baseline is None or c.current is None:
            continue
        direction = "under" if c.better == "higher" else "over"
        limit = c.limit if c.limit is not None else c.baseline
        gate = Gate(f"{c.metric} vs baseline", direction, round(_finite_or(limit, 0.0), 6))
        note = c.note or ("regressed" if c.regressed else "")
        results.append(gate_result(gate, c.current, not c.regressed, note))
    return results


def _finite_or(value: float, fallback: float) -> float:
    return value if math.isfinite(value) else fallback
