"""The ranges of a decoder's key/value cache, collected by the calibration pass.

A tap of the float pass: it takes each prefill of the token files and :data:`RANGE_STEPS` greedy decode steps
after it, so the ranges cover positions past the prompt, and keeps the largest magnitude of every cache output
per head and head dimension (:func:`qtool.quantization.emit.kv_cache.quantize_cache` turns them into scales).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qtool.calibration.decoder import DecoderInterface, last_token_scores, next_step_feed

if TYPE_CHECKING:
    from qtool.calibration.taps import Rerun

RANGE_STEPS = 8  # greedy decode steps after each calibration prefill whose cache the ranges include


class CacheRanges:
    """A tap of the calibration pass: the largest magnitude of each cache output, per head and head dimension.

    The float pass hands it each prefill's outputs; from there it runs :data:`RANGE_STEPS` greedy decode steps
    on the pass's own session, so the ranges (``largest``: output -> [heads, head_dim]) cover positions past the
    prompt. ``outputs``: every output of the model (a decode step's feed is made of them); ``samples`` counts the
    prefills it saw.
    """

    def __init__(self, decoder: DecoderInterface, outputs: list[str], presents: set[str]) -> None:
        self.decoder, self.outputs, self.presents = decoder, list(outputs), sorted(presents)
        self.largest: dict[str, np.ndarray] = {}
        self.samples = 0

    @property
    def tensors(self) -> list[str]:
        return list(self.outputs)

    def observe(
        self, values: dict[str, np.ndarray], count: int, feed: dict[str, np.ndarray], rerun: Rerun | None = None
    ) -> None:
        """Keep the prefill's cache magnitudes, then decode greedily from it and keep each step's."""
        assert rerun is not None  # the float pass runs the decode steps
        results = values
        for step in range(RANGE_STEPS + 1):
            if step:
                results = rerun(feed)
            for name in self.presents:
                value = np.abs(results[name]).max(axis=(0, 2))
                self.largest[name] = np.maximum(self.largest[name], value) if name in self.largest else value
            if step == RANGE_STEPS or self.decoder.logits is None:
                break
            tokens = last_token_scores(results[self.decoder.logits]).argmax(-1)
            feed = next_step_feed(self.decoder, feed, results, tokens)
        self.samples += count
