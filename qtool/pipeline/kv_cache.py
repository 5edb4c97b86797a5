"""The ``kv_cache:`` setting: a decoder's cache ranges taken in the calibration pass, the cache stored int8 at write."""

from __future__ import annotations

from pathlib import Path

import onnx

from qtool.calibration.kv_cache_ranges import RANGE_STEPS, CacheRanges
from qtool.choice.decode import decoder_to_score
from qtool.errors import QtoolError
from qtool.pipeline.workspace import Workspace
from qtool.quantization.emit.kv_cache import cache_nodes, quantize_cache

NO_CACHE_NOTE = (
    "kv_cache: the cache stays float: onnxruntime quantizes a cache only inside GroupQueryAttention "
    "(the contrib form its model builder and transformer optimizer write), and this model has none"
)


def check_kv_cache(ws: Workspace, data_dir: Path | str | None) -> None:
    """Refuse, before any work, a ``kv_cache:`` setting with no token files to calibrate it on.

    Raises:
        QtoolError: the setting is given without data.
    """
    if ws.config.kv_cache is not None and data_dir is None and cache_nodes(ws.prepared):
        raise QtoolError(
            "kv_cache: the cache's scales are calibrated on token files, and none were given",
            hint="give --data DIR (or --search-data DIR with --stats)",
        )


def cache_ranges_tap(ws: Workspace) -> CacheRanges | None:
    """The calibration pass's tap of the cache ranges, when ``kv_cache:`` is set and the model has a cache to store."""
    found = cache_nodes(ws.prepared)
    decoder = decoder_to_score(ws.prepared)
    if ws.config.kv_cache is None or not found or decoder is None:
        return None
    outputs = [o.name for o in ws.prepared.graph.output]
    return CacheRanges(decoder, outputs, {name for node in found for name in node.present})


def apply_kv_cache(ws: Workspace, model: onnx.ModelProto, ranges: CacheRanges | None) -> str | None:
    """Store ``model``'s key/value cache int8 as ``kv_cache:`` says; the note for the summary (None: unset).

    ``ranges``: the tap a float pass fed (see :func:`cache_ranges_tap`): calibration's, or with statistics read from a
    file the pass over the search samples (:func:`check_kv_cache` refused the setting without any).
    """
    setting = ws.config.kv_cache
    if setting is None:
        return None
    if ranges is None or not cache_nodes(model):
        return NO_CACHE_NOTE
    assert ranges.samples, "a float pass fed the cache ranges"
    changed = quantize_cache(model, ranges.largest, setting)
    return (
        f"key/value cache int8 {setting} in {len(changed)} GroupQueryAttention nodes: scales from "
        f"{ranges.samples} samples (each prefill and {RANGE_STEPS} greedy decode steps after it)"
    )
