"""The observer contract and the registry that finds observers by name.

An observer only collects statistics of the tensors it is shown; turning its
range into scale and zero point is :func:`qtool.numerics.qparams.compute_qparams`'s job.

Contract (what a third-party observer implements):

* ``name`` - a class attribute, the name users type.
* ``__init__(self, axis=None, **options)`` - keyword options with defaults;
  ``options()`` returns them so they can be written next to the state.
* ``observe(batch)`` - update the statistics with one batch (a numpy array).
* ``merge(other)`` - fold in another observer of the same kind and options.
* ``state()`` / ``load_state(state)`` - JSON-serialisable statistics and back.
* ``range(bits, symmetric)`` - the (min, max) to quantize to, scalars or one
  value per channel when ``axis`` is set.
* ``concurrent`` (optional class attribute, default False) - True when different instances
  may ``observe`` at the same time in different threads and it pays: calibration then observes a
  batch's tensors on all cores, and onnxruntime's idle workers sleep between runs instead of
  spinning (which slows models of many tiny layers). The histogram observers say True: their
  counting kernel releases the GIL. minmax does not: two numpy passes gain less than that costs.

Observers are found by built-in name, by the name of an installed plugin (the
``qtool.observers`` entry-point group) or by a ``package.module:ClassName``
reference. Plugins are imported only when a config or command names them.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from abc import ABC, abstractmethod
from importlib import metadata
from typing import Any, ClassVar

import numpy as np

from qtool.errors import QtoolError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "qtool.observers"


def check_range(lo: np.ndarray, hi: np.ndarray, axis: int | None) -> None:
    """Raise ValueError unless (lo, hi) can be a real tensor's range.

    One number each (per tensor) or two 1-D arrays of equal length (per channel), no NaN, and
    min <= max. Infinite values stay allowed: a model that produces inf is reported by the qparams
    step, naming the tensor.
    """
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    if axis is None and (lo.ndim != 0 or hi.ndim != 0):
        raise ValueError(f"a per-tensor range must be one number, got shapes {lo.shape} and {hi.shape}")
    if axis is not None and (lo.ndim != 1 or lo.shape != hi.shape):
        raise ValueError(f"a per-channel range must be two equal 1-D arrays, got {lo.shape} and {hi.shape}")
    if np.isnan(lo).any() or np.isnan(hi).any():
        raise ValueError("the range is NaN (statistics of no data?)")
    if (lo > hi).any():
        raise ValueError(f"min > max ({float(np.max(lo - hi)):g} apart)")


class Observer(ABC):
    """Collects statistics of one tensor across calibration batches.

    ``axis`` selects per-channel statistics along that axis; ``None`` means
    per-tensor.
    """

    name: ClassVar[str]
    concurrent: ClassVar[bool] = False  # instances may observe in parallel threads (see the module doc)

    def __init__(self, axis: int | None = None) -> None:
        self.axis = axis
        self.reference = self.name  # how it was asked for: a name or package.module:ClassName

    def options(self) -> dict[str, Any]:
        """The keyword options this observer was built with (JSON-serialisable)."""
        return {}

    @abstractmethod
    def observe(self, batch: np.ndarray) -> None:
        """Update the statistics with one batch of the tensor's values."""

    @abstractmethod
    def merge(self, other: Observer) -> None:
        """Fold another observer of the same kind into this one."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """JSON-serialisable statistics; an empty dict before any data."""

    def check(self) -> None:
        """Raise ValueError when merged statistics cannot be a real tensor's (see :func:`check_range`)."""
        check_range(*self.range(8, False), self.axis)

    @abstractmethod
    def load_state(self, state: dict[str, Any]) -> None:
        """Restore statistics written by :meth:`state`."""

    @abstractmethod
    def range(self, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        """The (min, max) range to quantize to ``bits`` bits; arrays per channel when ``axis`` is set."""

    def observed_range(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The exact minimum and maximum seen, when this observer keeps them (None: it does not)."""
        return None

    @classmethod
    def from_state(
        cls, state: dict[str, Any], axis: int | None = None, options: dict[str, Any] | None = None
    ) -> Observer:
        """Build an observer with ``options`` and load ``state`` into it."""
        observer = cls(axis=axis, **(options or {}))
        if state:
            observer.load_state(state)
        return observer

    @property
    def empty(self) -> bool:
        """True before the first batch was observed."""
        return not self.state()

    def copy(self) -> Observer:
        """An independent observer with the same options and statistics."""
        twin = type(self).from_state(self.state(), self.axis, self.options())
        twin.reference = self.reference
        return twin

    def _check_same_kind(self, other: Observer) -> None:
        if type(other) is not type(self) or other.axis != self.axis or other.options() != self.options():
            raise QtoolError(
                f"cannot merge observer '{other.name}' (axis={other.axis}, {other.options()}) into "
                f"'{self.name}' (axis={self.axis}, {self.options()})",
                hint="merge statistics produced with the same observer settings",
            )


_BUILTIN: dict[str, type[Observer]] = {}


def register_observer(cls: type[Observer]) -> type[Observer]:
    """Class decorator that makes an observer available by its ``name``."""
    _BUILTIN[cls.name] = cls
    return cls


def builtin_observers() -> dict[str, type[Observer]]:
    """The observers shipped with qtool, sorted by name."""
    return dict(sorted(_BUILTIN.items()))


def plugin_entry_points() -> dict[str, metadata.EntryPoint]:
    """Installed observer plugins by name (read from package metadata, nothing imported)."""
    found = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return dict(sorted(found.items()))


def available_observers() -> dict[str, type[Observer]]:
    """Built-in observers by name (plugins: see :func:`plugin_entry_points`)."""
    return builtin_observers()


def observer_options(cls: type[Observer]) -> dict[str, Any]:
    """An observer class's keyword options and their defaults."""
    parameters = inspect.signature(cls.__init__).parameters
    return {
        name: (None if p.default is inspect.Parameter.empty else p.default)
        for name, p in parameters.items()
        if name not in ("self", "axis") and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def describe_observers() -> list[dict[str, Any]]:
    """Built-in observers and installed plugins, for listings (plugins are not imported)."""
    rows: list[dict[str, Any]] = []
    for name, cls in builtin_observers().items():
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        rows.append({"name": name, "source": "built-in", "summary": summary, "options": observer_options(cls)})
    for name, ep in plugin_entry_points().items():
        dist = ep.dist.name if ep.dist is not None else "unknown package"
        rows.append({"name": name, "source": f"plugin ({dist})", "summary": ep.value, "options": None})
    return rows


def _checked(cls: Any, reference: str) -> type[Observer]:
    if not (inspect.isclass(cls) and issubclass(cls, Observer)):
        raise QtoolError(f"observer '{reference}' is not a subclass of qtool.observers.Observer")
    return cls


def _import_reference(reference: str) -> type[Observer]:
    module_name, _, attribute = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure of user code is reported the same way
        raise QtoolError(f"cannot import observer module '{module_name}': {type(e).__name__}: {e}") from e
    try:
        return _checked(getattr(module, attribute), reference)
    except AttributeError:
        raise QtoolError(f"module '{module_name}' has no observer class '{attribute}'") from None


TRUSTED_ENV = "QTOOL_OBSERVERS"  # comma-separated package.module:Class references the user allows


def trusted_references() -> set[str]:
    """``package.module:Class`` references the user named in the environment (``QTOOL_OBSERVERS``)."""
    return {r.strip() for r in os.environ.get(TRUSTED_ENV, "").split(",") if r.strip()}


def observer_class(reference: str, *, allow_import: bool = True) -> type[Observer]:
    """Find an observer by built-in name, plugin name or ``package.module:ClassName``.

    ``allow_import=False`` (references read from a statistics file) imports a module only when the
    user named it in ``QTOOL_OBSERVERS``: a file must never choose code to run.

    Raises:
        QtoolError: unknown name (the message lists the known ones), a broken plugin, or a module
            reference that is not allowed.
    """
    if reference in _BUILTIN:
        return _BUILTIN[reference]
    if ":" in reference:
        if not allow_import and reference not in trusted_references():
            raise QtoolError(
                f"observer '{reference}' names a Python module; qtool imports observer code only from built-ins, "
                "installed plugins, or a package.module:Class you name yourself",
                hint=f"name it with --observer or in the config, or list it in {TRUSTED_ENV}",
            )
        return _import_reference(reference)
    plugins = plugin_entry_points()
    if reference in plugins:
        try:
            return _checked(plugins[reference].load(), reference)
        except QtoolError:
            raise
        except Exception as e:  # a broken plugin must not take qtool down with a traceback
            raise QtoolError(f"observer plugin '{reference}' failed to load: {type(e).__name__}: {e}") from e
    known = [*_BUILTIN, *plugins]
    raise QtoolError(
        f"unknown observer '{reference}'",
        hint=f"available observers: {', '.join(sorted(known))}; or give package.module:ClassName",
    )


def create_observer(
    reference: str, axis: int | None = None, options: dict[str, Any] | None = None, *, allow_import: bool = True
) -> Observer:
    """Build an observer, with a clear error for options it does not take.

    ``allow_import``: see :func:`observer_class`.
    """
    cls = observer_class(reference, allow_import=allow_import)
    accepted = list(observer_options(cls))
    unknown = sorted(set(options or {}) - set(accepted))
    if unknown:
        raise QtoolError(
            f"observer '{reference}' has no option '{unknown[0]}'",
            hint=f"its options: {', '.join(accepted)}" if accepted else "it takes no options",
        )
    try:
        observer = cls(axis=axis, **(options or {}))
    except (TypeError, ValueError, OverflowError) as e:
        raise QtoolError(f"observer '{reference}': {e}") from e
    observer.reference = reference
    return observer
