"""Decode-step samples: where a decoder spends its time is one token with a long cache, not a prefill.

Token files are prefills. :func:`with_decode_steps` writes, beside each prefill, the decode step
that follows it: the float model's cache after the prefill as the past, and its greedy next token
as the input. Candidates scored on both are judged on prefills and on decode steps alike (their
cache outputs included), and the decode steps sort first, so a candidate timed on the first sample
is timed on a decode step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Dataset
from qtool.calibration.decoder import DecoderInterface, complete_feed, last_token_scores, next_step_feed
from qtool.calibration.outputs import FloatOutputs
from qtool.graph.session import run_session

DECODE_PREFIX, PREFILL_PREFIX = "decode-", "prefill-"  # "decode-" sorts first: the first sample is a decode step


def with_decode_steps(
    dataset: Dataset,
    session: ort.InferenceSession,
    decoder: DecoderInterface,
    directory: Path,
    known: FloatOutputs | None = None,
) -> Dataset:
    """``dataset``'s prefills and the decode step after each, as a dataset over ``directory`` (created).

    ``known`` receives the float outputs of the prefills (run here anyway), so scorers do not run them again.
    """
    directory.mkdir(parents=True, exist_ok=True)
    names = [o.name for o in session.get_outputs()]
    for path, sample in dataset.samples():
        prefill = complete_feed(decoder, sample)
        results = dict(zip(names, run_session(session, None, prefill, f"the float model on {path}"), strict=True))
        assert decoder.logits is not None  # decoders scored this way have logits (placement_decode)
        token = last_token_scores(results[decoder.logits]).argmax(-1)
        step = next_step_feed(decoder, prefill, results, token)
        stem = path.name.rsplit(".", 1)[0]
        arrays: dict[str, Any] = dict(step)
        np.savez(directory / f"{DECODE_PREFIX}{stem}.npz", **arrays)
        arrays = dict(prefill)
        np.savez(directory / f"{PREFILL_PREFIX}{stem}.npz", **arrays)
        if known is not None:
            known.add(directory / f"{PREFILL_PREFIX}{stem}.npz", results)
    return Dataset(directory, dataset.inputs)


def has_decode_steps(names: list[str]) -> bool:
    """Whether sample ``names`` include decode steps :func:`with_decode_steps` wrote."""
    return any(name.startswith(DECODE_PREFIX) for name in names)


def prefills(dataset: Dataset) -> Dataset:
    """The prefills of a dataset :func:`with_decode_steps` wrote (any other dataset as it is)."""
    positions = [i for i, path in enumerate(dataset.files) if not path.name.startswith(DECODE_PREFIX)]
    return dataset.subset(positions) if len(positions) < len(dataset.files) else dataset
