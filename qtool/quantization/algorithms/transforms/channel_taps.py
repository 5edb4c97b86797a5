"""The float-pass taps the data-dependent transforms (SmoothQuant, AWQ) measure their inputs with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from qtool.calibration.taps import Rerun


@dataclass
class TensorTap:
    """A float-pass tap that folds each batch of the tensors it names into statistics of its own."""

    names: list[str]

    @property
    def tensors(self) -> list[str]:
        """The tensors the float pass fetches for this tap."""
        return self.names

    def observe(
        self, values: dict[str, np.ndarray], count: int, feed: dict[str, np.ndarray], rerun: Rerun | None = None
    ) -> None:
        """Fold this batch of each named tensor into its statistics."""
        for name, value in values.items():
            self.add(name, value)

    def add(self, name: str, value: np.ndarray) -> None:
        """Fold one batch of ``name`` into the tap's statistics (each tap keeps its own)."""
        raise NotImplementedError
