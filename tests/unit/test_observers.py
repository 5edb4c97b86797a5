from __future__ import annotations

import numpy as np
import pytest

from qtool.errors import QtoolError
from qtool.observers import MinMaxObserver, available_observers, observer_class


def test_minmax_tracks_extremes_across_batches():
    obs = MinMaxObserver()
    obs.observe(np.array([1.0, 2.0]))
    obs.observe(np.array([-3.0, 0.5]))
    lo, hi = obs.range(8, False)
    assert float(lo) == -3.0 and float(hi) == 2.0


def test_minmax_merge_equals_observing_everything():
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(4, 3)) for _ in range(6)]
    whole, a, b = MinMaxObserver(axis=1), MinMaxObserver(axis=1), MinMaxObserver(axis=1)
    for i, batch in enumerate(batches):
        whole.observe(batch)
        (a if i < 3 else b).observe(batch)
    a.merge(b)
    assert a.state() == whole.state()
    assert len(whole.state()["min"]) == 3


def test_state_round_trip_and_empty_observer():
    obs = MinMaxObserver()
    assert obs.empty
    obs.observe(np.array([0.25, -0.5]))
    restored = MinMaxObserver.from_state(obs.state())
    assert restored.state() == obs.state() and not restored.empty


def test_merge_refuses_other_kinds_of_settings():
    with pytest.raises(QtoolError, match="cannot merge"):
        MinMaxObserver(axis=0).merge(MinMaxObserver(axis=None))


def test_registry_lists_minmax_and_names_the_choices_on_unknown():
    assert "minmax" in available_observers()
    with pytest.raises(QtoolError, match=r"available observers: .*minmax"):
        observer_class("nope")
