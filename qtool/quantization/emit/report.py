"""What the Q/DQ rewrite changed, node by node (read by the reports)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtool.numerics.saturation import PairFit


@dataclass
class RewriteReport:
    """What :func:`insert_qdq` changed."""

    quantized_nodes: list[str] = field(default_factory=list)
    chained_nodes: list[str] = field(default_factory=list)  # unweighted ops between integer kernels, in Q/DQ too
    quantized_weights: list[str] = field(default_factory=list)
    quantized_biases: list[str] = field(default_factory=list)
    quantized_activations: list[str] = field(default_factory=list)
    passthrough: dict[str, int] = field(default_factory=dict)  # op type -> nodes left untouched (no quantization)
    # weight -> quantized copies stored, for weights whose readers asked for different schemes (int4 and int8)
    weight_copies: dict[str, int] = field(default_factory=dict)
    algorithms: dict[str, list[str]] = field(default_factory=dict)  # node -> weight algorithms applied to it
    algorithm_notes: dict[str, str] = field(default_factory=dict)  # node -> why an algorithm it asked for was not
    pair_fits: dict[str, PairFit] = field(default_factory=dict)  # node -> how its int8 weight was fitted to the
    # kernel's pair limit (weight.saturation: auto)
    # integer node -> its qtool.schemes.PairGuard: how its 8-bit weight is stored against pair saturation ("int8",
    # "int8 fitted", "uint8" ...; str for the reports, which keep the name weight_forms)
    weight_forms: dict[str, str] = field(default_factory=dict)

    def merge(self, other: RewriteReport) -> None:
        """Add what another rewrite (a body's: an If branch, a Loop or Scan body) changed."""
        for name in (
            "quantized_nodes",
            "chained_nodes",
            "quantized_weights",
            "quantized_biases",
            "quantized_activations",
        ):
            getattr(self, name).extend(getattr(other, name))
        for op, count in other.passthrough.items():
            self.passthrough[op] = self.passthrough.get(op, 0) + count
        for name in ("weight_copies", "algorithms", "algorithm_notes", "pair_fits", "weight_forms"):
            getattr(self, name).update(getattr(other, name))
