"""Sensitivity measurements kept between ``tune`` runs, keyed by everything they depend on.

Measuring each node alone is about half of a tune run's time (PP-OCRv4's detector: 101 of 192 s), and a
second run on the same model, config and data (another target, another time budget, a CI rerun)
would measure the very same numbers. The key hashes the versions of qtool and of the libraries
behind the numbers, the CPU, the model's bytes, the config, the calibration options and samples (their
bytes), the evaluation samples the nodes are measured on (their bytes), the option space and the
thread count; any change measures anew.
Only complete measurements are kept. The cache is a convenience: a folder that cannot be read or
written is skipped with a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from qtool.choice.tune.sensitivity import Sensitivity
from qtool.errors import QtoolError
from qtool.system.files import read_json

log = logging.getLogger(__name__)

CACHE_ENV = "QTOOL_CACHE_DIR"
FORMAT = 1


def default_cache_dir() -> Path | None:
    """``$QTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/qtool``, else ``~/.cache/qtool`` (None: no home to use)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "qtool"
    try:
        return Path.home() / ".cache" / "qtool"
    except RuntimeError as e:  # no HOME and a user unknown to the password database
        log.warning("no tune cache: %s (set %s)", e, CACHE_ENV)
        return None


def cache_key(parts: dict[str, Any]) -> str:
    """SHA-256 of ``parts`` as canonical JSON (sorted keys; anything else as its text)."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def cache_file(directory: Path, key: str) -> Path:
    """Where the measurement under ``key`` is kept in ``directory``."""
    return directory / "tune" / f"sensitivity-{key[:40]}.json"


CACHE_MAX_BYTES = 64 << 20  # a table of a few numbers per node: megabytes for the largest models


def load_sensitivity(directory: Path, key: str, nodes: Sequence[str], options: Sequence[str]) -> Sensitivity | None:
    """The measurement kept under ``key``, or None (absent, unreadable, another key's, or not this model's).

    A bad file of any kind (not regular, too large, too deep, not JSON, non-finite or negative numbers,
    nodes or options the run does not have, or missing) is skipped with a warning, never an error.
    """
    path = cache_file(directory, key)
    if not path.exists() and not path.is_symlink():
        return None
    try:
        document = read_json(path, "tune cache file", CACHE_MAX_BYTES)
        sensitivity = _sensitivity(document, key, list(nodes), set(options))
    except QtoolError as e:
        log.warning("ignoring the tune cache file %s: %s", path, e)
        return None
    if sensitivity is not None:
        sensitivity.cache_file = str(path)
    return sensitivity


def _sensitivity(document: Any, key: str, nodes: list[str], options: set[str]) -> Sensitivity | None:
    """The measurement a cache document holds, checked against the run's nodes and options."""
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("key") != key:
        return None
    table, measured = document.get("nsr"), document.get("measured")
    if not isinstance(table, dict) or not isinstance(measured, dict) or set(table) != set(nodes):
        raise QtoolError(f"its table is not a measurement of this model's {len(nodes)} nodes")
    nsr: dict[str, dict[str, float]] = {}
    for node in nodes:
        row = table[node]
        if not isinstance(row, dict) or not row or not set(row) <= options:
            raise QtoolError(f"node {node!r}: not a row of this run's options")
        values = {option: math.inf if v is None else v for option, v in row.items()}
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values.values()):
            raise QtoolError(f"node {node!r}: noise-to-signal figures must be numbers >= 0 (or null)")
        nsr[node] = {option: float(v) for option, v in values.items()}
        names = measured.get(node)
        if not isinstance(names, list) or not all(isinstance(n, str) and n in row for n in names):
            raise QtoolError(f"node {node!r}: its measured options are not a list of its row's options")
    builds, seconds = document.get("builds"), document.get("seconds")
    if not isinstance(builds, int) or isinstance(builds, bool) or builds < 0:
        raise QtoolError("builds must be a count")
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
        raise QtoolError("seconds must be a duration")
    measured_options = {node: [str(n) for n in measured[node]] for node in nodes}
    return Sensitivity(nsr, measured_options, builds=builds, seconds=float(seconds), cached=True)


def save_sensitivity(directory: Path, key: str, sensitivity: Sensitivity) -> str | None:
    """Keep a complete measurement under ``key`` (atomically); the file written, or None."""
    if not sensitivity.complete:
        return None
    path = cache_file(directory, key)
    document = {
        "format": FORMAT,
        "key": key,
        "nsr": {
            node: {o: None if math.isinf(v) else v for o, v in row.items()} for node, row in sensitivity.nsr.items()
        },
        "measured": sensitivity.measured,
        "builds": sensitivity.builds,
        "seconds": sensitivity.seconds,
    }
    # Not one of the command's outputs (those commit together, see qtool.system.outputs): a file of its
    # own, renamed into place so that a reader never sees half of it, readable by whoever shares the cache.
    temporary: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
            handle.write(json.dumps(document, sort_keys=True))
        temporary.chmod(0o644)
        os.replace(temporary, path)
    except BaseException as e:
        if temporary is not None:
            with suppress(OSError):
                temporary.unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        log.warning("could not keep the sensitivity measurement in %s: %s", path.parent, e)
        return None
    return str(path)
