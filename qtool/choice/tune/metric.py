"""A user's task metric (``--metric module:function``), scored per evaluation sample and averaged.

The function receives the float model's outputs and the candidate's for one sample, as dicts of
output name -> numpy array, and, with ``--labels``, that sample's label as a third argument; it
returns a number. ``module`` is imported from the working directory first, or is a ``.py`` file.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qtool.calibration.samples import read_npy
from qtool.errors import QtoolError
from qtool.system.files import read_text

MetricFunction = Callable[..., Any]


def load_metric(spec: str) -> MetricFunction:
    """Import ``module:function`` (or ``path/to/file.py:function``); a clear error when it is not there."""
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise QtoolError(f"--metric expects module:function, got '{spec}'", hint="e.g. --metric mytask:top1")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise QtoolError(f"--metric: {path} not found")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or loader.loader is None:
                raise QtoolError(f"--metric: {path} is not a Python module")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except (QtoolError, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - the user's module failed (or exited) on import: say so in one line
        raise QtoolError(f"--metric: cannot import {module_name}: {_failure(e)}") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise QtoolError(f"--metric: {module_name} has no function '{function}'")
    return found


LABELS_MAX_BYTES = 64 << 20  # one label per evaluation sample: a few bytes each


def _failure(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {e}"


def read_labels(path: Path | str, samples: int) -> list[Any]:
    """One label per evaluation sample, in sample order: a ``.npy`` array (first axis) or a text file (lines).

    Read through qtool's bounded readers: a ``.npy`` header is checked before any allocation.
    """
    path = Path(path)
    try:
        if path.suffix == ".npy":
            array = read_npy(path, LABELS_MAX_BYTES)
            if array.ndim == 0:
                raise QtoolError(f"--labels: {path} holds a single value (a 0-d array), not one label per sample")
            labels: list[Any] = list(array)
        else:
            text = read_text(path, "--labels file", LABELS_MAX_BYTES)
            labels = [line.strip() for line in text.splitlines() if line.strip()]
    except QtoolError as e:
        raise QtoolError(str(e) if str(e).startswith("--labels") else f"--labels: {e}") from None
    if len(labels) != samples:
        raise QtoolError(f"--labels: {path} holds {len(labels)} labels for {samples} evaluation samples")
    return labels


def score_metric(
    function: MetricFunction,
    references: Sequence[dict[str, np.ndarray]],
    candidates: Sequence[dict[str, np.ndarray]],
    labels: Sequence[Any] | None,
    spec: str,
) -> list[float]:
    """``function`` on each sample; a non-number or a failure is the user's error, named."""
    values = []
    for index, (reference, candidate) in enumerate(zip(references, candidates, strict=True)):
        arguments = (reference, candidate) if labels is None else (reference, candidate, labels[index])
        try:
            value = float(function(*arguments))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's code (even sys.exit): one line naming it
            raise QtoolError(f"--metric {spec} failed on evaluation sample {index}: {_failure(e)}") from None
        if not math.isfinite(value):
            raise QtoolError(
                f"--metric {spec} returned {value} on evaluation sample {index}",
                hint="a metric must return a finite number for every sample",
            )
        values.append(value)
    return values
