"""What SmoothQuant's graph edit did: each smoothed group, and the tensors it left alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SmoothedGroup:
    """One activation tensor smoothed for the MatMul/Gemm nodes in ``nodes``, which share one ``s``.

    ``folded_into`` is the tensor's producer when ``1/s`` went into its parameters (``folded_chain``
    lists every node whose constants changed, producer first: an Add of a bias, then its MatMul);
    both are empty when a Mul node was inserted instead.
    """

    tensor: str
    nodes: tuple[str, ...]
    folded_into: str
    folded_chain: tuple[str, ...]
    alpha: float
    outlier_ratio: float


@dataclass(frozen=True)
class SmoothingReport:
    """What :func:`smooth` changed, and the tensors it left alone with the reason."""

    groups: tuple[SmoothedGroup, ...]
    # (tensor, reason). A tensor can be both smoothed and listed here, for a selected reader that is
    # not smoothable (its reason names the node); that reader keeps seeing the original tensor.
    skipped: tuple[tuple[str, str], ...]

    @property
    def folded(self) -> tuple[SmoothedGroup, ...]:
        return tuple(g for g in self.groups if g.folded_into)

    @property
    def inserted(self) -> tuple[SmoothedGroup, ...]:
        return tuple(g for g in self.groups if not g.folded_into)
