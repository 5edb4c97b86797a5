"""URLs, in-memory feeds and ``get_next()`` readers wherever the Python API takes a sample directory."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from inspect import signature
from pathlib import Path
from typing import Any, TypeVar, cast

from qtool.calibration.feeds import sample_directory
from qtool.calibration.remote import is_url
from qtool.options import CalibrationOptions, SearchOptions
from qtool.results import ComparisonResult, QuantizeResult

_F = TypeVar("_F", bound=Callable[..., Any])


def accepts_feeds(func: _F) -> _F:
    """Let ``func``'s sample directories also be URLs, iterables of feeds or ``get_next()`` readers.

    ``data_dir``, ``eval_dir`` and ``search.data_dir`` become temporary sample directories for the
    call (see :mod:`qtool.calibration.feeds`); a comparison in the result names the data as given.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature(func).bind(*args, **kwargs)
        given = {key: bound.arguments.get(key) for key in ("data_dir", "eval_dir")}
        search = bound.arguments.get("search")
        search_data = search.data_dir if isinstance(search, SearchOptions) else None
        for_workers = read_by_workers(bound.arguments)
        with (
            sample_directory(None if for_workers else given["data_dir"], "data") as directory,
            sample_directory(search_data, "search data") as search_directory,
            sample_directory(given["eval_dir"], "evaluation data") as eval_directory,
        ):
            if "data_dir" in bound.arguments and not for_workers:
                bound.arguments["data_dir"] = directory
            if "eval_dir" in bound.arguments:
                bound.arguments["eval_dir"] = eval_directory
            if isinstance(search, SearchOptions) and search_data is not None:
                bound.arguments["search"] = replace(search, data_dir=search_directory)
            result = func(*bound.args, **bound.kwargs)
        scored = "eval_dir" if given["eval_dir"] is not None else "data_dir"
        return named_data(result, str(bound.arguments.get(scored)), given[scored])

    return cast(_F, wrapper)


def named_data(result: Any, used: str, given: Any) -> Any:
    """``result`` with its comparison's data named as the caller gave it (a URL, feeds), not the temporary copy."""
    if given is None or (isinstance(given, (str, Path)) and not is_url(given)):
        return result
    shown = str(given) if is_url(given) else "feeds given from code"
    if isinstance(result, ComparisonResult) and result.data_dir == used:
        return replace(result, data_dir=shown)
    if isinstance(result, QuantizeResult) and result.comparison is not None and result.comparison.data_dir == used:
        result.comparison = replace(result.comparison, data_dir=shown)
    return result


def read_by_workers(arguments: Mapping[str, Any]) -> bool:
    """Whether ``data_dir`` is a URL that a running scheduler's workers read themselves (no local copy)."""
    options = arguments.get("options")
    return is_url(arguments.get("data_dir")) and isinstance(options, CalibrationOptions) and bool(options.scheduler)
