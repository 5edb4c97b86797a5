"""Placement candidates built in one line for the choice's tests."""

from __future__ import annotations

from collections.abc import Sequence

from qtool.schemas.reports.quantize import PlacementCandidate
from qtool.schemes import CandidateName


def candidate(
    name: CandidateName,
    integer: int,
    storage: int,
    sqnr: float,
    meets: bool,
    ms: float | None = None,
    same_as: Sequence[CandidateName] = (),
) -> PlacementCandidate:
    """A candidate with ``integer`` and ``storage`` nodes, its worst output and median latency (None: untimed)."""
    return PlacementCandidate(
        name=name,
        same_as=list(same_as),
        integer_nodes=integer,
        storage_nodes=storage,
        sqnr_db=sqnr,
        meets_target=meets,
        latency_ms=ms,
    )
