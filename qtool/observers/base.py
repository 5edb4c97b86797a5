"""The observer contract and the registry that finds observers by name.

An observer only collects statistics of the tensors it is shown; turning its
range into scale and zero point is :func:`qtool.qparams.compute_qparams`'s job.
Observers must be mergeable (calibration shards combine exactly) and
serialisable to JSON (statistics are written between ``calibrate`` and
``quantize``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from qtool.errors import QtoolError


class Observer(ABC):
    """Collects statistics of one tensor across calibration batches.

    Subclasses set ``name`` and implement the abstract methods. ``axis`` selects
    per-channel statistics along that axis; ``None`` means per-tensor.
    """

    name: ClassVar[str]

    def __init__(self, axis: int | None = None) -> None:
        self.axis = axis

    @abstractmethod
    def observe(self, batch: np.ndarray) -> None:
        """Update the statistics with one batch of the tensor's values."""

    @abstractmethod
    def merge(self, other: Observer) -> None:
        """Fold another observer of the same kind into this one."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """JSON-serialisable state, restorable with :meth:`from_state`."""

    @classmethod
    @abstractmethod
    def from_state(cls, state: dict[str, Any], axis: int | None = None) -> Observer:
        """Rebuild an observer from :meth:`state`'s output."""

    @abstractmethod
    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        """The (min, max) range to quantize to ``bits`` bits; arrays per channel when ``axis`` is set."""

    @property
    def empty(self) -> bool:
        """True before the first batch was observed."""
        return not self.state()

    def _check_same_kind(self, other: Observer) -> None:
        if type(other) is not type(self) or other.axis != self.axis:
            raise QtoolError(
                f"cannot merge observer '{other.name}' (axis={other.axis}) into '{self.name}' (axis={self.axis})",
                hint="merge statistics produced with the same observer settings",
            )


_BUILTIN: dict[str, type[Observer]] = {}


def register_observer(cls: type[Observer]) -> type[Observer]:
    """Class decorator that makes an observer available by its ``name``."""
    _BUILTIN[cls.name] = cls
    return cls


def available_observers() -> dict[str, type[Observer]]:
    """All observers known by name, sorted by name."""
    return dict(sorted(_BUILTIN.items()))


def observer_class(name: str) -> type[Observer]:
    """Find an observer class by name, with an error that lists the known ones."""
    known = available_observers()
    if name not in known:
        raise QtoolError(f"unknown observer '{name}'", hint=f"available observers: {', '.join(known)}")
    return known[name]
