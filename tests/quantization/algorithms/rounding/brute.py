"""Brute-force references for the algorithm tests: explicit loops, no cleverness."""

from __future__ import annotations

import itertools

import numpy as np


def im2col(
    x: np.ndarray,
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    pads: tuple[int, ...],
    dilations: tuple[int, ...],
    group: int,
) -> np.ndarray:
    """Every output position's patch, [N * prod(out), group, Cin/group * prod(kernel)], in (n, out...) order."""
    batch, channels, *spatial = x.shape
    rank = len(spatial)
    out = [
        (spatial[i] + pads[i] + pads[rank + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
        for i in range(rank)
    ]
    rows = []
    for n in range(batch):
        for position in itertools.product(*(range(o) for o in out)):
            patch = []
            for c in range(channels):
                for tap in itertools.product(*(range(k) for k in kernel)):
                    index = [position[i] * strides[i] + tap[i] * dilations[i] - pads[i] for i in range(rank)]
                    inside = all(0 <= index[i] < spatial[i] for i in range(rank))
                    patch.append(x[(n, c, *index)] if inside else 0.0)
            rows.append(np.array(patch).reshape(group, -1))
    return np.array(rows, np.float64)


def conv(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    strides: tuple[int, ...],
    pads: tuple[int, ...],
    dilations: tuple[int, ...],
    group: int,
) -> np.ndarray:
    """Float Conv as [positions, Cout] (positions in (n, out...) order), from :func:`im2col`."""
    patches = im2col(x, tuple(weight.shape[2:]), strides, pads, dilations, group)
    rows = weight.reshape(group, weight.shape[0] // group, -1).astype(np.float64)
    out = np.einsum("pgk,grk->pgr", patches, rows).reshape(len(patches), -1)
    return out if bias is None else out + bias
