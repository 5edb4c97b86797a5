"""Language-model metrics: perplexity, next-token agreement, and a greedy decode loop through the cache.

A quantized decoder can keep a high SQNR on prefills and still break generation: errors in the
key/value cache compound over decode steps. So for a decoder (see :mod:`qtool.calibration.decoder`)
``compare`` also measures, per sample (a token sequence):

* **perplexity**, teacher-forced: ``exp`` of the mean negative log-likelihood each model gives the
  sample's next tokens; the gateable figure is the candidate's over the reference's (``ppl_ratio``);
* **next-token agreement**: how often the candidate's most likely next token is the reference's, at
  every position of the prefill;
* **decode agreement**: the reference greedily continues the sample for ``steps`` tokens through
  its cache. The candidate is fed the same tokens through *its own* cache (one token per step, the
  cache growing), and its next token is compared at each step (``decode_agreement``); then it
  continues on its own, and its tokens are compared position by position with the reference's
  (``free_running_agreement``, with the mean run of tokens before the first difference).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Dataset
from qtool.calibration.dataset_types import Feed
from qtool.calibration.decoder import (
    DecoderInterface,
    complete_feed,
    last_token_scores,
    next_step_feed,
    prefix_feed,
)
from qtool.evaluation.confidence import CONFIDENCE, mean_bound
from qtool.graph.session import run_session
from qtool.options import DECODE_STEPS
from qtool.schemas.reports.compare import LanguageModel

MAX_DECODE_STEPS = 4096  # each step runs both models once per sample: more is a typo, not a measurement


def language_model_lines(score: LanguageModel) -> list[str]:
    """The figures as report lines (the same words in the terminal and in Markdown)."""
    lines = [
        f"perplexity {score.reference_perplexity:.4g} -> {score.candidate_perplexity:.4g} "
        f"(ratio {score.ppl_ratio:.4f}) over {score.tokens} tokens of {score.samples} samples",
        f"next-token agreement {score.next_token_agreement:.2%}",
    ]
    if score.decode_agreement is not None and score.free_running_agreement is not None:
        bound = score.free_running_bound
        bound_text = "" if bound is None else f"{CONFIDENCE:.0%} bound {bound:.2%} on new samples; "
        lines.append(
            f"greedy decode, {score.decode_steps} steps through the cache: step agreement "
            f"{score.decode_agreement:.2%}, free-running {score.free_running_agreement:.2%} ({bound_text}"
            f"first difference after {score.matched_prefix:.1f} tokens on average)"
        )
    return lines


def language_model_measured(score: LanguageModel) -> dict[str, float | None]:
    """The gateable numbers by metric name."""
    return {
        "ppl_ratio": score.ppl_ratio,
        "next_token": score.next_token_agreement,
        "decode_agreement": score.decode_agreement,
        "free_running": score.free_running_agreement,
    }


def _free_running_bound(by_sample: tuple[float, ...]) -> float | None:
    """The free-running agreement a new set of as many samples reaches at :data:`CONFIDENCE` (per-sample spread).

    One early difference costs a sample every token after it, so the per-sample figures spread
    widely and the mean of a few dozen samples moves by several points from one set to the next.
    """
    return mean_bound(by_sample, CONFIDENCE) if len(by_sample) >= 2 else None


class _Model:
    """One session and its decoder interface: runs a feed, returns outputs by name."""

    def __init__(self, session: ort.InferenceSession, decoder: DecoderInterface, label: str) -> None:
        self.session, self.decoder, self.label = session, decoder, label
        self.names = [o.name for o in session.get_outputs()]

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.names, run_session(self.session, None, dict(feed), self.label), strict=True))

    def logits(self, results: Mapping[str, np.ndarray]) -> np.ndarray:
        assert self.decoder.logits is not None  # checked by language_model_metrics
        return results[self.decoder.logits]

    def next_scores(self, results: Mapping[str, np.ndarray]) -> np.ndarray:
        """The scores of the token after the last one run: [batch, vocab]."""
        return last_token_scores(self.logits(results))

    def prefill(self, feed: Feed) -> tuple[Feed, dict[str, np.ndarray], np.ndarray]:
        """Run a prefill: (the feed a decode step follows, its outputs, the scores after every position).

        The scores are [batch, length, vocab]. A model that returns the last position's only is fed the
        sample one token at a time through its own cache (teacher-forced), as such models are run.
        """
        length = feed[self.decoder.input_ids].shape[1]
        results = self.run(feed)
        logits = self.logits(results)
        if logits.ndim == 3 and logits.shape[1] == length:
            return feed, results, logits
        if length == 1:
            return feed, results, last_token_scores(logits)[:, None]
        return self._stepped(feed, length)

    def _stepped(self, feed: Feed, length: int) -> tuple[Feed, dict[str, np.ndarray], np.ndarray]:
        """:meth:`prefill` one token at a time: through the cache, or as growing prefills where none is returned."""
        ids = feed[self.decoder.input_ids]
        through_cache = all(c.present is not None for c in self.decoder.cache)
        step = prefix_feed(self.decoder, feed, 1)
        results = self.run(step)
        scores = [self.next_scores(results)]
        for position in range(1, length):
            if through_cache:
                step = next_step_feed(self.decoder, step, results, ids[:, position])
                if self.decoder.attention_mask is not None:  # the sample's own mask, where it gave one
                    mask = feed[self.decoder.attention_mask]
                    step[self.decoder.attention_mask] = mask[:, : mask.shape[1] - length + position + 1]
            else:
                step = prefix_feed(self.decoder, feed, position + 1)
            results = self.run(step)
            scores.append(self.next_scores(results))
        return step, results, np.stack(scores, axis=1)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _nll(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[:, 1:] given logits[:, :-1], over unmasked targets."""
    logp = _log_softmax(logits[:, :-1])
    picked = np.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    keep = mask[:, 1:].astype(bool)
    return float(-picked[keep].sum()), int(keep.sum())


def _greedy(model: _Model, feed: Mapping[str, np.ndarray], results: Mapping[str, np.ndarray], steps: int) -> np.ndarray:
    """The model's own greedy continuation after the prefill ``feed`` (which gave ``results``): [batch, steps]."""
    tokens = [model.next_scores(results).argmax(-1)]
    for _ in range(steps - 1):
        feed = next_step_feed(model.decoder, feed, results, tokens[-1])
        results = model.run(feed)
        tokens.append(model.next_scores(results).argmax(-1))
    return np.stack(tokens, axis=1)


def _forced(
    model: _Model, feed: Mapping[str, np.ndarray], results: Mapping[str, np.ndarray], given: np.ndarray
) -> np.ndarray:
    """The model's next token at each step when fed ``given`` [batch, steps] through its cache."""
    predicted = [model.next_scores(results).argmax(-1)]
    for step in range(given.shape[1] - 1):
        feed = next_step_feed(model.decoder, feed, results, given[:, step])
        results = model.run(feed)
        predicted.append(model.next_scores(results).argmax(-1))
    return np.stack(predicted, axis=1)


def _prefix(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Per row, the tokens before the first difference."""
    same = ours == theirs
    return np.where(same.all(axis=1), same.shape[1], same.argmin(axis=1))


@dataclass(frozen=True)
class ReferenceRun:
    """What the reference gave on one sample: all a candidate is scored against (its logits are not kept)."""

    sample: Mapping[str, np.ndarray]  # as read: each candidate completes it for its own interface
    ids: np.ndarray  # [batch, length]
    mask: np.ndarray  # [batch, length]: positions that count
    nll: float  # summed over the scored next tokens
    scored: int
    argmax: np.ndarray  # [batch, length]: the most likely next token at each position
    continued: np.ndarray | None  # [batch, steps]: the greedy continuation (None: no decode loop)


def reference_runs(
    reference: ort.InferenceSession, decoder: DecoderInterface, dataset: Dataset, steps: int
) -> list[ReferenceRun]:
    """The reference's prefill and greedy continuation of every sample, run once for any number of candidates."""
    ref = _Model(reference, decoder, "reference")
    runs = []
    for _, sample in dataset.samples():
        feed = complete_feed(decoder, sample)
        ids = feed[decoder.input_ids]
        mask = feed.get(decoder.attention_mask or "", np.ones_like(ids))[:, -ids.shape[1] :]
        feed, first, logits = ref.prefill(feed)
        nll, scored = _nll(logits, ids, mask)
        continued = _greedy(ref, feed, first, steps) if steps > 0 else None
        runs.append(ReferenceRun(sample, ids, mask, nll, scored, logits.argmax(-1), continued))
    return runs


@dataclass
class _Decoded:
    """The decode loops' tallies over the samples: tokens matched fed the reference's, and on the candidate's own."""

    forced_same: int = 0
    free_same: int = 0
    generated: int = 0
    prefixes: list[int] = field(default_factory=list)
    by_sample: list[float] = field(default_factory=list)

    def add(
        self,
        cand: _Model,
        feed: Mapping[str, np.ndarray],
        first: Mapping[str, np.ndarray],
        continued: np.ndarray,
        *,
        forced: bool,
        free: bool,
    ) -> None:
        """Decode one sample's continuation both ways (as asked) and count the tokens that match the reference's."""
        if forced:
            self.forced_same += int((_forced(cand, feed, first, continued) == continued).sum())
        if free:
            own = _greedy(cand, feed, first, continued.shape[1])
            self.free_same += int((own == continued).sum())
            self.by_sample.append(float((own == continued).mean()))
            self.prefixes.extend(int(p) for p in _prefix(own, continued))
        self.generated += continued.size


def language_model_metrics(
    reference: ort.InferenceSession | list[ReferenceRun],
    candidate: ort.InferenceSession,
    decoders: tuple[DecoderInterface, DecoderInterface],
    dataset: Dataset,
    *,
    steps: int = DECODE_STEPS,
    on_progress: Callable[[int], None] | None = None,
    forced: bool = True,
    free: bool = True,
) -> LanguageModel:
    """Perplexity, next-token and decode agreement of ``candidate`` against ``reference`` (see the module).

    ``reference``: the float model's session, or its :func:`reference_runs` on ``dataset`` with ``steps``
    when several candidates are scored against it (then it is not run again). ``forced``/``free``: run the
    decode loop fed the reference's tokens / the candidate's own (a figure not run is None).
    """
    runs = reference if isinstance(reference, list) else reference_runs(reference, decoders[0], dataset, steps)
    cand = _Model(candidate, decoders[1], "candidate")
    nll_ref = nll_cand = 0.0
    scored = agree = positions = 0
    decoded = _Decoded()
    for index, run in enumerate(runs, start=1):
        feed = complete_feed(cand.decoder, run.sample)
        feed, first, logits = cand.prefill(feed)
        nll_ref, scored = nll_ref + run.nll, scored + run.scored
        nll_cand += _nll(logits, run.ids, run.mask)[0]
        keep = run.mask.astype(bool)
        agree += int((run.argmax == logits.argmax(-1))[keep].sum())
        positions += int(keep.sum())
        if run.continued is not None:
            decoded.add(cand, feed, first, run.continued, forced=forced, free=free)
        if on_progress is not None:
            on_progress(index)
    # every sample a single token (decode steps with their past): no next token inside a sample to score
    # perplexity on (NaN, tokens 0); the agreements and the decode loop are measured all the same
    reference_perplexity = math.exp(nll_ref / scored) if scored else math.nan
    candidate_perplexity = math.exp(nll_cand / scored) if scored else math.nan
    return LanguageModel(
        logits=decoders[0].logits or "",
        samples=len(runs),
        tokens=scored,
        reference_perplexity=reference_perplexity,
        candidate_perplexity=candidate_perplexity,
        ppl_ratio=candidate_perplexity / reference_perplexity,
        next_token_agreement=agree / max(1, positions),
        decode_steps=steps,
        decode_agreement=decoded.forced_same / decoded.generated if decoded.generated and forced else None,
        free_running_agreement=decoded.free_same / decoded.generated if decoded.generated and free else None,
        free_running_bound=_free_running_bound(tuple(decoded.by_sample)),
        matched_prefix=float(np.mean(decoded.prefixes)) if decoded.prefixes else None,
        free_running_by_sample=tuple(decoded.by_sample),
    )
