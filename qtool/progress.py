"""Progress reporting between the library and a front end (the CLI draws bars)."""

from __future__ import annotations

from collections.abc import Callable

# Called once per unit of work with (description, total) -> a callback taking the units done.
ProgressFactory = Callable[[str, int], Callable[[int], None]]


def noop_progress(description: str, total: int) -> Callable[[int], None]:
    """A progress factory that reports nowhere (library calls without a bar)."""
    return lambda n: None
