"""External data read by memory map: weights are paged in from their file when used, and dropped after.

A model's external weights can outweigh what a quantization run may hold in memory. Mapped read-only,
a weight costs memory only while it is being read; :func:`release` gives its pages back (the values
stay readable: the next read pages them in from the file again), so a run that quantizes one weight
after another holds about one weight at a time instead of all of them. onnxruntime reads the same
pages through the OrtValues :meth:`qtool.graph.weights.Weights.session_options` hands it.

The mapped arrays are read-only: a stage that changed a weight in place would have changed the input
model's file, so it raises instead.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_PAGE = mmap.PAGESIZE


@dataclass(frozen=True, eq=False)
class MappedRegion:
    """Where a mapped array's bytes lie in its file's map."""

    map: mmap.mmap
    offset: int
    length: int


class FileMaps:
    """One read-only map per external data file of one model (a file mapped once, however many tensors)."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def array(
        self, target: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...]
    ) -> tuple[np.ndarray, MappedRegion]:
        """The values at ``offset`` of ``target`` as a read-only array backed by the file's map."""
        mapped = self._maps.get(target)
        if mapped is None:
            with open(target, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[target] = mapped
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        values = np.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)
        return values, MappedRegion(mapped, offset, count * dtype.itemsize)


def mappable(offset: int, dtype: np.dtype) -> bool:
    """True when an array at ``offset`` would be aligned for its type (onnxruntime and BLAS want that)."""
    return offset % dtype.itemsize == 0


def release(region: MappedRegion) -> None:
    """Drop the region's pages from this process's memory; its values stay readable from the file."""
    start = region.offset - region.offset % _PAGE
    end = min(len(region.map), region.offset + region.length)
    if end > start and hasattr(mmap, "MADV_DONTNEED"):
        region.map.madvise(mmap.MADV_DONTNEED, start, end - start)
