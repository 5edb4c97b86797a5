"""The placement choice's settings: the command line over the config, checked before any work."""

from __future__ import annotations

import pytest

from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.options import SearchOptions
from qtool.pipeline.choose import accuracy_settings, check_search


def test_options_given_override_the_config_and_the_rest_is_the_configs():
    given = load_config({"accuracy": {"target_sqnr_db": 25, "samples": 4}}).accuracy
    settings = accuracy_settings(given, SearchOptions(target_sqnr_db=35.0, latency_runs=0))
    assert (settings.target_sqnr_db, settings.samples, settings.latency_runs) == (35.0, 4, 0)
    assert settings.max_float_nodes == given.max_float_nodes


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (SearchOptions(max_float_nodes=0), "max-float-nodes"),
        (SearchOptions(search_seconds=0), "search-seconds"),
        (SearchOptions(latency_runs=-1), "latency-runs"),
    ],
)
def test_settings_that_cannot_mean_anything_are_refused(options, message):
    with pytest.raises(QtoolError, match=message):
        check_search(options)
