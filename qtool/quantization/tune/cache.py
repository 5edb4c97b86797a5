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
from contextlib import suppress
from pathlib import Path
from typing import Any

from qtool.quantization.tune.sensitivity import Sensitivity

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


def load_sensitivity(directory: Path, key: str) -> Sensitivity | None:
    """The measurement kept under ``key``, or None (absent, unreadable or another key's)."""
    path = cache_file(directory, key)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the tune cache file %s: %s", path, e)
        return None
    try:
        if document["format"] != FORMAT or document["key"] != key:
            return None
        table = {
            str(node): {str(o): math.inf if v is None else float(v) for o, v in row.items()}
            for node, row in document["nsr"].items()
        }
        measured = {str(node): [str(o) for o in names] for node, names in document["measured"].items()}
        return Sensitivity(
            table,
            measured,
            builds=int(document["builds"]),
            seconds=float(document["seconds"]),
            cache_file=str(path),
            cached=True,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        log.warning("ignoring the tune cache file %s: not a sensitivity table (%s)", path, e)
        return None


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
