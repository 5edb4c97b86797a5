"""Spreading one job's independent pieces over processes or machines.

:func:`open_engine` gives an :class:`Engine` that runs a function over a list of items and
reports progress from every worker; Dask distributed is the engine behind it (the optional
``distributed`` extra). Another engine (Ray, say) needs only the same two things: ``workers``
and ``run``.
"""

from qtool.distributed.engine import Engine, EngineSpec, open_engine

__all__ = ["Engine", "EngineSpec", "open_engine"]
