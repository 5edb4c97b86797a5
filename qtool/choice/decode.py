"""Decoders in the placement choice: each candidate's greedy decode through its own cache, against the float model.

A placement can keep its SQNR on prefills and still break generation, because the error in the
key/value cache compounds step by step. For a decoder (see :mod:`qtool.calibration.decoder`) the
choice runs :data:`DECODE_STEPS` greedy steps per scored sample with every candidate
(:func:`qtool.evaluation.language_model.language_model_metrics`), and a candidate whose decode-step
agreement falls below the dynamic-int8 placement's is not kept: dynamic int8 (weights int8,
activations quantized per run) is the form every runtime offers, so no chosen placement decodes worse.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
import onnxruntime as ort

from qtool.calibration.dataset import Dataset
from qtool.calibration.decoder import DecoderInterface, model_decoder
from qtool.errors import QtoolError
from qtool.evaluation.language_model import language_model_metrics, reference_runs
from qtool.graph.session import create_session
from qtool.graph.weights import Weights
from qtool.options import DECODE_STEPS
from qtool.schemas.reports.compare import LanguageModel
from qtool.schemes import CandidateName

BAR = "dynamic"  # the placement whose decode agreement every kept candidate must reach


def decoder_to_score(model: onnx.ModelProto) -> DecoderInterface | None:
    """The model's decoder interface when the decode loop can run (logits and a returned cache), else None."""
    try:
        decoder = model_decoder(model)
    except QtoolError:
        return None
    if decoder is None or decoder.logits is None or any(c.present is None for c in decoder.cache):
        return None
    return decoder


class DecodeJudge:
    """The float model's greedy decodes of the scored prefills, run once; each candidate is scored against them."""

    def __init__(
        self,
        float_model: onnx.ModelProto,
        weights: Weights,
        decoder: DecoderInterface,
        dataset: Dataset,
        threads: int | None = None,
        steps: int = DECODE_STEPS,
    ) -> None:
        self.weights, self.decoder, self.dataset, self.threads = weights, decoder, dataset, threads
        self.steps = steps
        reference = create_session(float_model, "the float model", threads=threads, weights=weights)
        self.runs = reference_runs(reference, decoder, dataset, steps)

    def score(self, session: ort.InferenceSession, *, forced: bool = True, free: bool = True) -> LanguageModel:
        """A candidate's language-model figures against the float model's runs (``forced``/``free``: which loops)."""
        decoders = (self.decoder, self.decoder)
        return language_model_metrics(
            self.runs, session, decoders, self.dataset, steps=self.steps, forced=forced, free=free
        )

    def agreement(self, name: str, model: onnx.ModelProto) -> float:
        """The candidate's decode-step agreement with the float model, fed its tokens through its own cache."""
        session = create_session(model, f"the '{name}' placement", threads=self.threads, weights=self.weights)
        score = self.score(session, free=False)  # the free-running loop would double the time, unread
        return score.decode_agreement if score.decode_agreement is not None else 0.0


def decode_bar(
    agreements: Mapping[CandidateName, float], aliases: Mapping[CandidateName, list[CandidateName]]
) -> float | None:
    """The dynamic placement's agreement (it may share its plan with another candidate's name)."""
    for name, others in aliases.items():
        if (name == BAR or BAR in others) and name in agreements:
            return agreements[name]
    return None
