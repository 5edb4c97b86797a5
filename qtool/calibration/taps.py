"""What else the calibration pass feeds: taps that see each batch of the tensors they name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Feed
from qtool.graph.session import run_session

Rerun = Callable[[Feed], dict[str, np.ndarray]]
"""Runs the float pass's session on another feed and returns a tap's tensors (a decoder's next step)."""


class BatchTap(Protocol):
    """Something else the float pass feeds: it names the tensors it needs and sees each batch of them.

    ``rerun`` runs the pass's own session on a feed of the tap's making, so a tap that follows a sample further
    (a decoder's greedy steps) needs no session of its own.
    """

    @property
    def tensors(self) -> list[str]: ...

    def observe(
        self, values: dict[str, np.ndarray], count: int, feed: dict[str, np.ndarray], rerun: Rerun | None = None
    ) -> None: ...


class Taps:
    """The taps of one float pass: the tensors they need, and each batch handed to each of them."""

    def __init__(self, taps: Sequence[BatchTap]) -> None:
        self.taps = list(taps)
        self.tensors = list(dict.fromkeys(name for tap in self.taps for name in tap.tensors))
        self.session: ort.InferenceSession | None = None
        self.fetch: dict[str, str] = {}

    def run_on(self, session: ort.InferenceSession, fetch: dict[str, str]) -> None:
        """The pass's session, and the output name each tensor is fetched under."""
        self.session, self.fetch = session, fetch

    def observe(self, by_name: dict[str, np.ndarray], count: int, feed: Feed) -> None:
        """Hand each tap its tensors of this batch (``by_name``: the pass's outputs by fetched name)."""
        for tap in self.taps:
            values = {name: np.asarray(by_name[self.fetch[name]]) for name in tap.tensors}
            tap.observe(values, count, feed, self._rerun(tap.tensors))

    def _rerun(self, tensors: list[str]) -> Rerun:
        session, wanted = self.session, [self.fetch[name] for name in tensors]
        assert session is not None  # run_on comes first

        def rerun(feed: Feed) -> dict[str, np.ndarray]:
            values = run_session(session, wanted, feed, "the float model (a tap's further run)")
            return dict(zip(tensors, values, strict=True))

        return rerun
