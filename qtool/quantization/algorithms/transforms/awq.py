"""AWQ's per-input-channel scales (Lin et al., 2023): ``s = mean|x|^alpha``, normalised.

For ``Y = X W`` (``W [K, N]`` quantized blockwise along K) the error a weight row adds to ``Y``
is its rounding error times its input: rows read by large activations matter most. Multiplying
row ``k`` by ``s_k > 1`` and dividing input channel ``k`` by it leaves ``Y`` unchanged in exact
arithmetic, but makes that row a larger share of its block's range, so it is rounded with a
smaller relative error. :func:`channel_scales` gives ``s`` for one ``alpha``; the search over
``alpha`` and the graph edit are :func:`~qtool.quantization.algorithms.transforms.graph_transforms.choose_awq_scales`
and :func:`~qtool.quantization.algorithms.transforms.graph_transforms.apply_awq`.
"""

from __future__ import annotations

import numpy as np

MEAN_FLOOR = 1e-4  # channels quieter than this fraction of the loudest are treated as this loud


def channel_scales(input_mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """``mean|x|^alpha`` normalised so that its largest and smallest entries multiply to 1: float32 [K]."""
    mean = np.asarray(input_mean_abs, np.float64)
    top = mean.max(initial=0.0)
    if top <= 0:
        return np.ones(mean.shape, np.float32)
    powered = np.maximum(mean, MEAN_FLOOR * top) ** alpha
    return (powered / np.sqrt(powered.max() * powered.min())).astype(np.float32)
