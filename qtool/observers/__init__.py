"""Observers: pluggable collectors of activation statistics."""

from qtool.observers.base import Observer, available_observers, observer_class, register_observer
from qtool.observers.minmax import MinMaxObserver

__all__ = ["MinMaxObserver", "Observer", "available_observers", "observer_class", "register_observer"]
