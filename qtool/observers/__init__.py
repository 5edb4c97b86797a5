"""Observers: pluggable collectors of activation statistics (see :mod:`qtool.observers.base`)."""

from qtool.observers.base import (
    ENTRY_POINT_GROUP,
    Observer,
    available_observers,
    builtin_observers,
    create_observer,
    describe_observers,
    observer_class,
    observer_options,
    plugin_entry_points,
    register_observer,
)
from qtool.observers.entropy import EntropyObserver
from qtool.observers.mean_std import MeanStdObserver
from qtool.observers.minmax import MinMaxObserver, MovingAverageObserver
from qtool.observers.mse import MseObserver
from qtool.observers.percentile import PercentileObserver

__all__ = [
    "ENTRY_POINT_GROUP",
    "EntropyObserver",
    "MeanStdObserver",
    "MinMaxObserver",
    "MovingAverageObserver",
    "MseObserver",
    "Observer",
    "PercentileObserver",
    "available_observers",
    "builtin_observers",
    "create_observer",
    "describe_observers",
    "observer_class",
    "observer_options",
    "plugin_entry_points",
    "register_observer",
]
