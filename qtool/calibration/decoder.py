"""Decoder language models: which inputs are the tokens and the key/value cache, and how to feed them.

An exported decoder (optimum, torch.onnx, onnxruntime's model builder) takes ``input_ids`` and a
cache of past keys and values (``past_key_values.{i}.key`` [batch, kv_heads, past, head_dim]),
often with ``attention_mask`` and ``position_ids`` (``cache_position``, and optimum's merged decoders'
``use_cache_branch``); it returns ``logits`` and the grown cache
(``present.{i}.key``). :func:`find_decoder` recognises that interface from the inputs' names and
shapes alone; :func:`complete_feed` turns a token file (``input_ids`` only) into a full prefill
feed, and :func:`next_step_feed` builds the one-token decode step that follows a run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from qtool.calibration.dataset_types import Feed, InputSpec, model_inputs

_PAST = re.compile(r"past", re.IGNORECASE)
_IDS_NAMES = ("input_ids", "ids", "tokens", "input_tokens")


@dataclass(frozen=True)
class CacheInput:
    """One past key or value input, the output that returns it grown, and its fixed sizes."""

    past: str
    present: str | None
    heads: int
    head_dim: int
    dtype: np.dtype

    def empty(self, batch: int) -> np.ndarray:
        """The cache of a prefill: no past positions."""
        return np.zeros((batch, self.heads, 0, self.head_dim), dtype=self.dtype)


@dataclass(frozen=True)
class DecoderInterface:
    """The inputs and outputs that make a model a decoder with a key/value cache."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    cache: tuple[CacheInput, ...]
    logits: str | None  # the next-token scores: [batch, sequence, vocab], or [batch, vocab] for the last token only
    cache_position: str | None = None  # [sequence]: the positions of the new tokens (newer transformers exports)
    cache_branch: str | None = None  # optimum's merged decoders: a bool [1], true once the cache holds tokens
    dtypes: Mapping[str, np.dtype] = field(default_factory=dict)  # the integer inputs qtool fills, by name

    def integers(self, name: str) -> np.dtype:
        """The dtype the model takes for ``name``, an integer input qtool fills (int64 when it does not say)."""
        return self.dtypes.get(name, np.dtype(np.int64))

    @property
    def filled(self) -> set[str]:
        """The inputs qtool can fill when a sample leaves them out."""
        names = {c.past for c in self.cache}
        optional = (self.attention_mask, self.position_ids, self.cache_position, self.cache_branch)
        return names | {n for n in optional if n is not None}


def _ids_input(inputs: Sequence[InputSpec]) -> InputSpec | None:
    integers = [spec for spec in inputs if np.issubdtype(spec.dtype, np.integer)]
    for wanted in _IDS_NAMES:
        for spec in integers:
            if spec.name.lower() == wanted or spec.name.lower().endswith("." + wanted):
                return spec
    return None


def _present_name(past: str, outputs: Sequence[str]) -> str | None:
    """The output that returns ``past`` grown: the same name with 'present' for 'past_key_values'/'past'."""
    for candidate in (past.replace("past_key_values", "present"), _PAST.sub("present", past, count=1)):
        if candidate in outputs and candidate != past:
            return candidate
    return None


def find_decoder(inputs: Sequence[InputSpec], outputs: Sequence[InputSpec | str] = ()) -> DecoderInterface | None:
    """The model's decoder interface, or None when it takes no token ids or no rank-4 past cache.

    A cache input needs fixed head and head-size dimensions (dims 1 and 3), as every exporter writes them.
    ``outputs``: the model's outputs, as specs (their dtypes and shapes find the logits: see
    :func:`logits_output`) or as names alone.
    """
    specs = [o if isinstance(o, InputSpec) else InputSpec(o, np.dtype(np.float32), None) for o in outputs]
    output_names = [o.name for o in specs]
    ids = _ids_input(inputs)
    if ids is None:
        return None
    cache = []
    for spec in inputs:
        shape = spec.shape
        if not _PAST.search(spec.name) or shape is None or len(shape) != 4:
            continue
        heads, head_dim = shape[1], shape[3]
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            continue
        cache.append(CacheInput(spec.name, _present_name(spec.name, output_names), heads, head_dim, spec.dtype))
    if not cache:
        return None
    names = {spec.name for spec in inputs}
    presents = {c.present for c in cache}
    integers = {s.name: s.dtype for s in inputs if s.name in _FILLED_INTEGERS and np.issubdtype(s.dtype, np.integer)}
    return DecoderInterface(
        ids.name,
        "attention_mask" if "attention_mask" in names else None,
        "position_ids" if "position_ids" in names else None,
        tuple(cache),
        logits_output([o for o in specs if o.name not in presents]),
        cache_position="cache_position" if "cache_position" in names else None,
        cache_branch="use_cache_branch" if "use_cache_branch" in names else None,
        dtypes=integers,
    )


_FILLED_INTEGERS = ("attention_mask", "position_ids", "cache_position")


def logits_output(outputs: Sequence[InputSpec]) -> str | None:
    """Of a decoder's outputs other than its cache, the next-token scores: by role, wherever they are listed.

    Logits are floating point, of rank 3 ([batch, sequence, vocab]) or 2 (the last token's only); an
    output named ``logits`` (or holding the word) is taken first, then the one with the widest fixed
    last dimension (the vocabulary), then the first that fits. None: no output can be the logits.
    """
    fitting = [
        o for o in outputs if np.issubdtype(o.dtype, np.floating) and (o.shape is None or len(o.shape) in (2, 3))
    ]
    for chosen in (
        [o for o in fitting if o.name == "logits"],
        [o for o in fitting if "logit" in o.name.lower()],
        sorted(
            (o for o in fitting if o.shape is not None and isinstance(o.shape[-1], int)),
            key=lambda o: -int(o.shape[-1]) if o.shape is not None and isinstance(o.shape[-1], int) else 0,
        ),
        fitting,
    ):
        if chosen:
            return chosen[0].name
    return None


def last_token_scores(logits: np.ndarray) -> np.ndarray:
    """The last position's scores [batch, vocab], whether the model returns every position's or the last's only."""
    return logits[:, -1] if logits.ndim == 3 else logits


def model_outputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph's outputs as specs (dtype float32 and any shape where the model does not say)."""
    specs = []
    for value in model.graph.output:
        tensor_type = value.type.tensor_type
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        except (KeyError, TypeError, ValueError):
            dtype = np.dtype(np.float32)
        shape = None
        if tensor_type.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
            )
        specs.append(InputSpec(value.name, dtype, shape))
    return specs


def model_decoder(model: onnx.ModelProto) -> DecoderInterface | None:
    """:func:`find_decoder` on a model's own inputs and outputs."""
    return find_decoder(model_inputs(model), model_outputs(model))


def past_length(decoder: DecoderInterface, feed: Mapping[str, np.ndarray]) -> int:
    """Positions already in the cache of ``feed`` (0 for a prefill with an empty or absent cache)."""
    first = feed.get(decoder.cache[0].past)
    return int(first.shape[2]) if first is not None and first.ndim == 4 else 0


def complete_feed(decoder: DecoderInterface, feed: Mapping[str, np.ndarray]) -> Feed:
    """``feed`` with the inputs a token file leaves out: an empty cache, a mask of ones, positions in order.

    Inputs the sample holds are kept as they are.
    """
    out = dict(feed)
    ids = np.asarray(out[decoder.input_ids])
    if ids.ndim == 1:
        ids = ids[np.newaxis]
        out[decoder.input_ids] = ids
    batch, length = ids.shape
    past = past_length(decoder, out)
    for cache in decoder.cache:
        out.setdefault(cache.past, cache.empty(batch))
    if decoder.attention_mask is not None and decoder.attention_mask not in out:
        out[decoder.attention_mask] = np.ones((batch, past + length), dtype=decoder.integers(decoder.attention_mask))
    if decoder.position_ids is not None and decoder.position_ids not in out:
        positions = np.arange(past, past + length, dtype=decoder.integers(decoder.position_ids))
        out[decoder.position_ids] = np.broadcast_to(positions, (batch, length)).copy()
    if decoder.cache_position is not None and decoder.cache_position not in out:
        out[decoder.cache_position] = np.arange(past, past + length, dtype=decoder.integers(decoder.cache_position))
    if decoder.cache_branch is not None and decoder.cache_branch not in out:
        out[decoder.cache_branch] = np.array([past > 0])
    return out


def next_step_feed(
    decoder: DecoderInterface,
    previous: Mapping[str, np.ndarray],
    results: Mapping[str, np.ndarray],
    tokens: np.ndarray,
) -> Feed:
    """The decode step after running ``previous``: one token per row, the returned cache as the past.

    Args:
        decoder: the model's interface.
        previous: the feed just run (its mask and positions are extended by one; any other input, such as a
            seq2seq decoder's encoder states and encoder mask, is passed on as it was).
        results: that run's outputs by name (the present cache).
        tokens: the next token of each row, [batch].
    """
    stepped = {decoder.input_ids, decoder.attention_mask, decoder.position_ids, decoder.cache_position}
    stepped |= {decoder.cache_branch, *(cache.past for cache in decoder.cache)}
    feed: Feed = {name: value for name, value in previous.items() if name not in stepped}
    feed[decoder.input_ids] = tokens.astype(previous[decoder.input_ids].dtype).reshape(-1, 1)
    for cache in decoder.cache:
        if cache.present is None:
            raise ValueError(f"no output returns the cache input '{cache.past}'")
        present = results[cache.present]
        # a merged seq2seq decoder's cached step returns its encoder cache empty (it never changes): the past stays
        feed[cache.past] = previous[cache.past] if present.size == 0 and cache.past in previous else present
    if decoder.attention_mask is not None:
        mask = previous[decoder.attention_mask]
        feed[decoder.attention_mask] = np.concatenate([mask, np.ones((mask.shape[0], 1), mask.dtype)], axis=1)
    if decoder.position_ids is not None:
        positions = previous[decoder.position_ids]
        feed[decoder.position_ids] = positions[:, -1:] + 1
    if decoder.cache_position is not None:
        feed[decoder.cache_position] = previous[decoder.cache_position][-1:] + 1
    if decoder.cache_branch is not None:
        feed[decoder.cache_branch] = np.array([True])
    return feed


def prefix_feed(decoder: DecoderInterface, feed: Mapping[str, np.ndarray], tokens: int) -> Feed:
    """The prefill ``feed`` cut to its first ``tokens`` new tokens (mask, positions and cache positions with them)."""
    out = dict(feed)
    ids = feed[decoder.input_ids]
    new = ids.shape[1]
    out[decoder.input_ids] = ids[:, :tokens]
    if decoder.attention_mask is not None and decoder.attention_mask in feed:
        mask = feed[decoder.attention_mask]
        out[decoder.attention_mask] = mask[:, : mask.shape[1] - new + tokens]
    if decoder.position_ids is not None and decoder.position_ids in feed:
        out[decoder.position_ids] = feed[decoder.position_ids][:, :tokens]
    if decoder.cache_position is not None and decoder.cache_position in feed:
        out[decoder.cache_position] = feed[decoder.cache_position][:tokens]
    return out
