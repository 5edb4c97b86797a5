"""Stage timings for ``qtool -v``: each stage logs when it starts and how long it took."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("qtool")


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Log ``name`` at the start and with its duration at the end (INFO: shown by ``-v``)."""
    log.info("%s ...", name)
    started = time.perf_counter()
    yield
    log.info("%s: %.2f s", name, time.perf_counter() - started)
