"""Analytic bias correction: cancel the mean output shift that rounding the weight causes.

A quantized weight ``W~ = W + dW`` shifts each output's mean by ``dW E[x_patch]``; adding
``-dW E[x_patch]`` to the bias removes it exactly on the calibration inputs, which lowers
the output MSE by ``||dW E[x_patch]||^2``. It needs only the mean patch, no extra model run.
"""

from __future__ import annotations

import numpy as np

from qtool.errors import QtoolError


def bias_correction(float_rows: np.ndarray, quantized_rows: np.ndarray, mean_patch: np.ndarray) -> np.ndarray:
    """The vector to add to the bias: ``-sum_k (W~ - W)[o, k] E[x_patch, k]`` per output ``o``.

    Args:
        float_rows: the float weight as [rows, K] (``gptq.weight_rows``).
        quantized_rows: the dequantized weight, same layout.
        mean_patch: ``E[x_patch]`` as [K] or [groups, K] (``InputStats.mean()``); rows split evenly by group.

    Returns:
        float32 [rows]; a node without a bias gets this as its new bias.
    """
    delta = np.asarray(quantized_rows, np.float64) - np.asarray(float_rows, np.float64)
    return (-mean_output(delta, mean_patch)).astype(np.float32)


def mean_output(rows: np.ndarray, mean_patch: np.ndarray) -> np.ndarray:
    """``rows`` [rows, K] times the mean patch ([K] or [groups, K], rows split evenly by group): float64 [rows]."""
    weight = np.asarray(rows, np.float64)
    mean = np.asarray(mean_patch, np.float64)
    mean = mean[None] if mean.ndim == 1 else mean
    count, k = weight.shape
    groups = mean.shape[0]
    if mean.shape[1] != k or count % groups:
        raise QtoolError(
            f"a mean patch of shape {np.shape(mean_patch)} does not fit a weight of {count} rows x {k} columns",
            hint="the input statistics were collected for another node",
        )
    return np.einsum("grk,gk->gr", weight.reshape(groups, count // groups, k), mean).reshape(count)
