"""The ``kv_cache:`` setting at write time: calibrate a decoder's cache ranges and store the cache int8."""

from __future__ import annotations

from pathlib import Path

import onnx

from qtool.choice.decode import decoder_to_score
from qtool.errors import QtoolError
from qtool.graph.session import create_session
from qtool.pipeline.data import full_dataset
from qtool.pipeline.workspace import Workspace
from qtool.progress import ProgressFactory, noop_progress
from qtool.quantization.emit.kv_cache import RANGE_STEPS, cache_nodes, cache_ranges, quantize_cache
from qtool.system.stages import stage


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


def apply_kv_cache(
    ws: Workspace, model: onnx.ModelProto, data_dir: Path | str | None, progress: ProgressFactory | None
) -> str | None:
    """Quantize ``model``'s key/value cache as the config's ``kv_cache:`` says; the note for the summary (None: unset).

    Raises:
        QtoolError: the setting is given without token files to calibrate the cache on (see :func:`check_kv_cache`).
    """
    setting = ws.config.kv_cache
    if setting is None:
        return None
    _, granularity = setting
    found = cache_nodes(model)
    decoder = decoder_to_score(ws.prepared)
    if not found or decoder is None:
        return (
            "kv_cache: the cache stays float: onnxruntime quantizes a cache only inside GroupQueryAttention "
            "(the contrib form its model builder and transformer optimizer write), and this model has none"
        )
    check_kv_cache(ws, data_dir)
    assert data_dir is not None  # checked above
    dataset = full_dataset(ws, data_dir)
    presents = {name for node in found for name in node.present}
    with stage(f"key/value cache ranges on {len(dataset)} samples"):
        session = create_session(ws.prepared, "the float model", weights=ws.weights)
        on_sample = (progress or noop_progress)("key/value cache", len(dataset))
        ranges = cache_ranges(session, decoder, dataset, presents, on_sample)
    changed = quantize_cache(model, ranges, granularity)
    return (
        f"key/value cache int8 {granularity} in {len(changed)} GroupQueryAttention nodes: scales from "
        f"{len(dataset)} samples (each prefill and {RANGE_STEPS} greedy decode steps after it)"
    )
