"""onnxruntime execution providers: short names, availability, and honest skipping."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from qtool.errors import QtoolError

ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
}


def parse_providers(text: str) -> list[str]:
    """``"cpu,cuda"`` (short or full onnxruntime names) -> full names, in order, without duplicates.

    Raises:
        QtoolError: a name that is neither an alias nor an onnxruntime provider name.
    """
    known = set(ALIASES.values()) | set(ort.get_all_providers())
    names: list[str] = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        name = ALIASES.get(raw.lower(), raw)
        if name not in known:
            raise QtoolError(
                f"unknown execution provider '{raw}'",
                hint=f"use one of {', '.join(sorted(set(ALIASES)))} or a full name like CUDAExecutionProvider",
            )
        if name not in names:
            names.append(name)
    if not names:
        raise QtoolError("--providers needs at least one provider")
    return names


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot run in this onnxruntime build, or None when it is available."""
    if name in ort.get_available_providers():
        return None
    return f"not available in this onnxruntime build (available: {', '.join(ort.get_available_providers())})"


def require_available(names: list[str]) -> None:
    """Refuse providers this onnxruntime build cannot run (``compare --require-providers``)."""
    missing = [name for name in names if unavailable_reason(name) is not None]
    if missing:
        raise QtoolError(
            f"required execution provider{'s' if len(missing) > 1 else ''} {', '.join(missing)} not available "
            f"(available: {', '.join(ort.get_available_providers())})",
            hint="install onnxruntime-gpu (the gpu extra) on a machine with an NVIDIA GPU, or drop --require-providers",
        )


ProviderSpec = str | tuple[str, dict[str, str]]
GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider"})


def session_providers(name: str, trt_engine_cache: str | None = None) -> list[ProviderSpec]:
    """The provider list for a session on ``name``; CPU (and CUDA under TensorRT) take what it cannot run.

    ``trt_engine_cache``: TensorRT keeps the engines it builds in this directory, so a later run
    with the same model and shapes loads them instead of building again.
    """
    if name == "CPUExecutionProvider":
        return [name]
    if name == "TensorrtExecutionProvider":
        options = (
            {"trt_engine_cache_enable": "True", "trt_engine_cache_path": trt_engine_cache} if trt_engine_cache else {}
        )
        if trt_engine_cache:  # created only now, when a session needs it: every check has passed
            try:
                Path(trt_engine_cache).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise QtoolError(f"cannot create --trt-engine-cache {trt_engine_cache}: {e.strerror or e}") from e
        first: ProviderSpec = (name, options) if options else name
        return [first, "CUDAExecutionProvider", "CPUExecutionProvider"]
    return [name, "CPUExecutionProvider"]
