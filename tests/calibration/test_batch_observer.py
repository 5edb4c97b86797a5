"""Calibration observes a batch's tensors on every core, with the statistics of one thread."""

from __future__ import annotations

import json
import threading
from typing import ClassVar

import numpy as np
import pytest

from qtool.calibration import statistics
from qtool.calibration.statistics import _BatchObserver
from qtool.observers import MinMaxObserver, create_observer


def _batches(rng: np.random.Generator) -> list[list[np.ndarray]]:
    shapes = [(1, 64, 40, 40), (1, 8, 20, 20), (1, 3), (1, 128, 30)]
    return [[(rng.standard_normal(s) * (1 + b)).astype(np.float32) for s in shapes] for b in range(4)]


def _states(names: list[str], batches, cores: int, monkeypatch) -> tuple[str, int]:
    monkeypatch.setattr(statistics, "_cores", lambda: cores)
    observers = [create_observer(n) for n in names]
    observe = _BatchObserver(observers)
    try:
        for values in batches:
            observe(values)
    finally:
        observe.close()
    return json.dumps([o.state() for o in observers]), observe.threads


@pytest.mark.parametrize("names", [["percentile", "entropy", "mse", "percentile"], ["mse"] * 4])
def test_statistics_do_not_depend_on_the_number_of_threads(monkeypatch, names):
    batches = _batches(np.random.default_rng(0))
    one, threads_one = _states(names, batches, 1, monkeypatch)
    many, threads_many = _states(names, batches, 3, monkeypatch)
    assert (threads_one, threads_many) == (1, 3)
    assert many == one


class _Plugin(MinMaxObserver):
    """A third-party observer that does not say it may run in parallel."""

    name = "plugin"
    concurrent = False
    threads: ClassVar[set[str]] = set()

    def observe(self, batch: np.ndarray) -> None:
        _Plugin.threads.add(threading.current_thread().name)
        super().observe(batch)


def test_observers_that_do_not_say_concurrent_run_in_the_calling_thread(monkeypatch):
    monkeypatch.setattr(statistics, "_cores", lambda: 4)
    observe = _BatchObserver([_Plugin(), create_observer("percentile")])
    observe([np.ones(10, np.float32), np.ones(10, np.float32)])
    observe.close()
    assert observe.threads == 1 and _Plugin.threads == {threading.current_thread().name}


class _Broken(MinMaxObserver):
    name = "broken"
    concurrent = True

    def observe(self, batch: np.ndarray) -> None:
        raise ValueError("broken observer")


def test_an_observer_error_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(statistics, "_cores", lambda: 2)
    observe = _BatchObserver([create_observer("percentile"), _Broken()])
    assert observe.threads == 2
    with pytest.raises(ValueError, match="broken observer"):
        observe([np.ones(1000, np.float32), np.ones(10, np.float32)])  # the larger tensor runs here
    observe.close()
