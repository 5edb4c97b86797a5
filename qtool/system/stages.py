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
    log.info("%s: %.2f s (peak memory so far %.0f MB)", name, time.perf_counter() - started, peak_rss_mb())


def peak_rss_mb() -> float:
    """The peak resident memory of this process in MB (VmHWM on Linux, ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
