"""Spreading one job's independent pieces over processes or machines.

:func:`open_engine` gives an :class:`Engine` that runs a function over a list of items and
reports progress from every worker; Dask distributed is the engine behind it (the optional
``distributed`` extra). Another engine (Ray, say) needs only the same two things: ``workers``
and ``run``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from qtool.distributed.engine import Engine, EngineSpec


@contextmanager
def open_engine(spec: EngineSpec) -> Iterator[Engine]:
    """The engine ``spec`` asks for, shut down (its local workers stopped) on the way out."""
    from qtool.distributed.dask_engine import dask_engine

    with dask_engine(spec) as engine:
        yield engine


__all__ = ["Engine", "EngineSpec", "open_engine"]
