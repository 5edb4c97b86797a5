"""onnxruntime sessions: quiet options, and failures turned into QtoolError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from qtool.dataset import Feed
from qtool.errors import QtoolError


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def session_options(
    *, threads: int | None = None, level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
) -> ort.SessionOptions:
    """Quiet, deterministic onnxruntime session options."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = level
    if threads:
        options.intra_op_num_threads = threads
    return options


def create_session(
    model: onnx.ModelProto | str | Path,
    what: str,
    *,
    threads: int | None = None,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    providers: list[str] | None = None,
) -> ort.InferenceSession:
    """An onnxruntime CPU session, with a QtoolError naming ``what`` if onnxruntime refuses the model."""
    source: str | bytes = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    try:
        return ort.InferenceSession(
            source, session_options(threads=threads, level=level), providers=providers or ["CPUExecutionProvider"]
        )
    except Exception as e:  # onnxruntime raises its own untyped exception family
        raise QtoolError(f"onnxruntime cannot load {what}: {_first_line(e)}") from e


def run_session(session: ort.InferenceSession, names: list[str] | None, feed: Feed, what: str) -> list[Any]:
    """``session.run`` with onnxruntime's failures turned into a QtoolError naming ``what``."""
    try:
        return session.run(names, feed)
    except Exception as e:
        raise QtoolError(f"onnxruntime failed running {what}: {_first_line(e)}") from e
