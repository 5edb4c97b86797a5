"""Measurement helpers shared by the benchmark workers and the memory test."""

from __future__ import annotations

import resource


def peak_rss_kb() -> int:
    """This process's peak resident memory in KiB.

    VmHWM belongs to the process's own address space. ``ru_maxrss`` would also
    count the parent's memory at fork time, which Linux carries across exec.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
