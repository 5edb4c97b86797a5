"""TensorRT's INT8 calibration cache, written from qtool's statistics.

Users who build engines with ``trtexec --int8 --calib=FILE`` (or an ``IInt8Calibrator`` that reads
a cache) can reuse qtool's calibration instead of running TensorRT's. The format is text: a header
line ``TRT-<version>-EntropyCalibration2``, then one line per tensor, ``name: <hex>``, where
``<hex>`` is the IEEE-754 bit pattern of the float32 scale as an 8-digit hexadecimal number and
the scale is the tensor's symmetric int8 step: ``amax / 127``. The version is TensorRT's
``NV_TENSORRT_VERSION`` number (``major * 10000 + minor * 100 + patch`` since TensorRT 10;
``major * 1000 + minor * 100 + patch`` before, e.g. 8601 for 8.6.1).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from qtool.errors import QtoolError
from qtool.graph.float16 import float32_names
from qtool.graph.model_io import load_model
from qtool.graph.weights import Weights
from qtool.observers import Observer

CALIBRATOR = "EntropyCalibration2"
DEFAULT_VERSION = "10.0.0"  # written when TensorRT is not installed and no --tensorrt-version is given


def tensorrt_version_number(version: str) -> int:
    """TensorRT's version number for a ``major.minor.patch`` string (``10.3.0`` -> 100300, ``8.6.1`` -> 8601)."""
    match = re.fullmatch(r"(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?:\.\d{1,8}){0,2}", version.strip())
    if match is None:
        shown = version if len(version) <= 40 else version[:40] + "..."
        raise QtoolError(f"TensorRT version '{shown}' is not major.minor[.patch]", hint="for example 10.3.0")
    major, minor, patch = int(match[1]), int(match[2]), int(match[3] or 0)
    return major * 10000 + minor * 100 + patch if major >= 10 else major * 1000 + minor * 100 + patch


def installed_tensorrt_version() -> str | None:
    """The installed ``tensorrt`` Python package's version, if there is one."""
    try:
        import tensorrt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return str(tensorrt.__version__)


def check_cache_name(name: str) -> None:
    """Refuse a tensor name the cache's one-line-per-tensor text cannot hold (it has no escapes)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or not name.strip():
        raise QtoolError(
            f"tensor {name!r} has a control character (a line break, say) or no visible character in its name: "
            "a TensorRT calibration cache holds one 'name: scale' line per tensor and cannot write it",
            hint="rename the tensor in the model, or calibrate without --tensorrt-cache",
        )


def check_cache_names(names: Iterable[str]) -> None:
    """:func:`check_cache_name` for every tensor that may be written (before any work)."""
    for name in names:
        check_cache_name(name)


def scale_hex(scale: float) -> str:
    """The bit pattern of a float32 scale as TensorRT writes it: 8 hexadecimal digits."""
    return format(struct.unpack(">I", struct.pack(">f", scale))[0], "08x")


def model_tensor_names(path: Path | str) -> dict[str, str]:
    """The model's tensor names (graph inputs, node outputs), by the name its statistics give each.

    The statistics of a float16 model are of its float32 form, whose inputs and outputs are renamed
    (``x`` computes as ``x/float32``, the same values): the cache names the model's own tensors.
    """
    model = load_model(path, Weights())
    own = [value.name for value in model.graph.input]
    own += [name for node in model.graph.node for name in node.output if name]
    names = {name: name for name in own}
    names |= {inner: name for name, inner in float32_names(model.graph).items()}
    return names


def tensorrt_cache_text(
    observers: Mapping[str, Observer], version: str, names: Mapping[str, str] | None = None
) -> tuple[str, list[str]]:
    """The cache text for every observed per-tensor activation, in name order; and the tensors left out.

    ``names``: :func:`model_tensor_names` of the model the cache describes: each statistics tensor is
    written under its name there, and one the model does not have is left out (None: as named).

    Raises:
        QtoolError: no tensor has statistics, or the version is malformed.
    """
    lines = [f"TRT-{tensorrt_version_number(version)}-{CALIBRATOR}"]
    left_out = []
    for key, observer in sorted(observers.items(), key=lambda item: (names or {}).get(item[0], item[0])):
        if observer.empty or observer.axis is not None:
            continue
        name = key if names is None else names.get(key)
        if name is None:
            left_out.append(key)
            continue
        check_cache_name(name)
        lo, hi = observer.range(8, True)
        amax = float(max(abs(float(np.min(lo))), abs(float(np.max(hi)))))
        scale = amax / 127.0 if amax > 0 and np.isfinite(amax) else 1.0 / 127.0
        lines.append(f"{name}: {scale_hex(scale)}")
    if len(lines) == 1:
        raise QtoolError("the statistics hold no activation ranges to write into a TensorRT cache")
    return "\n".join(lines) + "\n", left_out
