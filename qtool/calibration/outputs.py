"""The float model's outputs, kept per sample file as calibration computes them.

Calibration runs the float model over every sample anyway; keeping its (usually small)
outputs lets the placement choice and ``quantize --data``'s comparison skip running the
float model again on the same files. Outputs past a byte budget are not kept: those
samples are simply run again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

KEPT_BYTES = 256 << 20


class FloatOutputs:
    """Output name -> value, per sample file, within ``budget`` bytes in all."""

    def __init__(self, budget: int = KEPT_BYTES) -> None:
        self.budget = budget
        self.used = 0
        self._values: dict[str, dict[str, np.ndarray]] = {}

    def add(self, path: Path, values: dict[str, np.ndarray]) -> None:
        """Keep one sample's outputs (nothing, once the budget is spent)."""
        size = sum(v.nbytes for v in values.values())
        if self.used + size <= self.budget:
            self._values[str(Path(path).resolve())] = values
            self.used += size

    def get(self, path: Path, names: list[str]) -> list[np.ndarray] | None:
        """The outputs ``names`` of the sample at ``path``, when all were kept."""
        kept = self._values.get(str(Path(path).resolve()))
        if kept is None or not all(name in kept for name in names):
            return None
        return [kept[name] for name in names]

    @property
    def samples(self) -> int:
        """How many samples' outputs are kept."""
        return len(self._values)
