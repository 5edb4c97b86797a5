"""How much output error each node adds at each precision, measured one node at a time.

For every tuned node and every measured option, a model with only that node quantized runs on a
few evaluation samples (the set the target is judged on) against float outputs computed once (see
:class:`qtool.evaluation.scoring.OutputScorer`). The error is kept as noise-to-signal power
(``10 ** (-SQNR / 10)``), which adds up across nodes to first order: the allocation budgets its sum.
Options not measured are derived: int16 activations from int8 ones (256x finer), fp16 as negligible.
Nodes the time budget leaves unmeasured get the worst measured figure of each option.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qtool.choice.tune.space import FP16_NSR, INT16_GAIN, MEASURED, Option
from qtool.errors import QtoolError


def nsr(sqnr_db: float) -> float:
    """Noise-to-signal power from SQNR in dB (0 for an exact match)."""
    if math.isnan(sqnr_db):
        return math.inf
    return 0.0 if sqnr_db == math.inf else 10 ** (-sqnr_db / 10)


def sqnr_db(noise: float) -> float:
    """SQNR in dB from noise-to-signal power."""
    return math.inf if noise <= 0 else -10 * math.log10(noise)


@dataclass
class Sensitivity:
    """Noise-to-signal power each node adds with each option (``inf``: the option fails there)."""

    nsr: dict[str, dict[str, float]] = field(default_factory=dict)
    measured: dict[str, list[str]] = field(default_factory=dict)  # node -> options actually measured
    builds: int = 0
    seconds: float = 0.0
    complete: bool = True  # False when the time budget stopped the measurement
    cache_file: str | None = None  # where it was read from or kept (see qtool.choice.tune.cache)
    cached: bool = False  # read from cache_file instead of measured in this run
    samples: list[str] = field(default_factory=list)  # the evaluation sample files measured on
    nodes: int = 0  # the nodes tuned (the measured ones, and those the time budget left estimated)

    def of(self, node: str, option: str) -> float:
        return self.nsr.get(node, {}).get(option, math.inf)


def measure(
    nodes: Sequence[str],
    options: Sequence[Option],
    score: Callable[[dict[str, Option]], float],
    *,
    deadline: float = math.inf,
    advance: Callable[[int], None] | None = None,
    budget: float = math.inf,
) -> Sensitivity:
    """Measure each node alone (``score`` builds the model with only the given nodes quantized -> SQNR dB).

    ``nodes`` should come largest first: when ``deadline`` (a ``time.monotonic()`` value) passes,
    the rest are estimated from the measured ones. ``budget``: the most noise-to-signal power any
    allocation may have; int2 is not measured on a node whose int4 options alone exceed it (int2
    adds more noise, so no allocation could give it to that node).
    """
    started = time.monotonic()
    result = Sensitivity()
    allowed = {o.name: o for o in options}
    to_measure = [allowed[name] for name in MEASURED if name in allowed]
    for node in nodes:
        if time.monotonic() > deadline:
            result.complete = False
            break
        row: dict[str, float] = {}
        measured = []
        for option in to_measure:
            if advance:
                advance(1)
            if option.name in LOWER_THAN_INT4 and min(row.get(o, math.inf) for o in INT4) > budget:
                row[option.name] = math.inf
                continue
            try:
                row[option.name] = nsr(score({node: option}))
            except QtoolError:  # the option cannot be applied to this node (its op or weight layout)
                row[option.name] = math.inf
            result.builds += 1
            measured.append(option.name)
        result.nsr[node] = row
        result.measured[node] = measured
    worst = {
        name: max((r[name] for r in result.nsr.values() if math.isfinite(r.get(name, math.inf))), default=math.inf)
        for name in MEASURED
    }
    for node in nodes:
        row = result.nsr.setdefault(node, {})
        if not result.measured.get(node):
            row.update({name: worst[name] for name in MEASURED if name in allowed})
            result.measured[node] = []
        _derive(row, allowed)
    result.seconds = time.monotonic() - started
    return result


INT4 = ("w4", "w4g")
LOWER_THAN_INT4 = ("w2",)  # measured only where an int4 option alone fits the noise budget


def _derive(row: dict[str, float], allowed: dict[str, Option]) -> None:
    """Fill in the options that are not measured from those that are."""
    if "w8a16" in allowed:
        weight, both = row.get("w8", math.inf), row.get("w8a8", math.inf)
        row["w8a16"] = weight + max(0.0, both - weight) * INT16_GAIN if math.isfinite(both) else weight
    if "fp16" in allowed:
        row["fp16"] = FP16_NSR
    row["float"] = 0.0
