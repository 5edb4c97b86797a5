"""The reproducibility block: versions, CPU, and fingerprints of everything a report depends on."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path
from typing import Any

_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile", "amx_bf16", "neon", "asimddp")


# numpy's runtime CPU detection (CPUID on x86, hwcaps on ARM; Linux, macOS and Windows alike) -> our names
_NUMPY_FLAGS = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512VNNI": "avx512_vnni", "NEON": "neon", "ASIMDDP": "asimddp"}


def cpu_info() -> dict[str, Any]:
    """CPU model and the instruction-set flags that decide which integer kernels run.

    Flags come from numpy's own CPU detection, which works on every OS, completed by
    ``/proc/cpuinfo`` where it exists (AVX-VNNI and AMX, which numpy does not report).
    """
    model, flags = platform.processor() or platform.machine(), set()
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features  # numpy >= 2

        flags |= {ours for theirs, ours in _NUMPY_FLAGS.items() if features.get(theirs)}
    except ImportError:  # older numpy: /proc/cpuinfo below, where there is one
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return {"model": model, "machine": platform.machine(), "flags": sorted(f for f in _FLAGS if f in flags)}


def int8_kernels_saturate(flags: list[str], machine: str) -> bool:
    """Whether onnxruntime's uint8 x int8 kernels saturate here (x86 without any VNNI)."""
    x86 = machine.lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    return x86 and not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags)


def files_digest(paths: list[Path]) -> str:
    """SHA-256 over the sorted file names and contents (what a dataset directory holds)."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode() + b"\0")
        if path.is_dir():
            for inner in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(str(inner.relative_to(path)).encode() + b"\0" + inner.read_bytes())
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def versions() -> dict[str, str]:
    """Versions of qtool and the libraries whose behaviour the numbers depend on."""
    import numpy
    import onnx
    import onnxruntime

    from qtool._version import __version__

    return {
        "qtool": __version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }
