"""The calibration inputs of the nodes whose weight algorithms need them, gathered on the float pass.

A :class:`NodeInputCollector` rides along the calibration pass (see
:func:`qtool.calibration.statistics.collect_statistics`): it names the node inputs it needs
exposed and turns each batch into :class:`InputStats` (patch Hessian and mean patch) per node.
Its cost is bounded whatever the data set: it looks at most at its budget's samples (``MAX_SAMPLES``) spread
over the pass, each node's Hessian sums at most ``POSITIONS_PER_NODE`` patches, nodes whose reduction is longer than
``MAX_REDUCTION`` are left to nearest rounding, and all Hessians together stay under
``HESSIAN_BUDGET_BYTES``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper

from qtool.quantization.algorithms.rounding.gptq import WeightKind
from qtool.quantization.algorithms.rounding.patches import (
    ConvGeometry,
    Geometry,
    InputStats,
    MatMulGeometry,
    input_stats,
)

if TYPE_CHECKING:
    from qtool.calibration.taps import Rerun

POSITIONS_PER_NODE = 32_768  # at most this many patches are summed into one node's Hessian over the whole pass
POSITIONS_PER_INPUT = 32  # ... and at most this many per Hessian row: a K x K estimate needs a few times K
MIN_POSITIONS = 2048
MAX_SAMPLES = 16  # samples observed (spread over the pass): the statistics cost more than the model run
MIN_POSITIONS_PER_BATCH = 64
MAX_REDUCTION = 2304  # a longer reduction (K) makes the K x K Hessian and its inverse cost hundreds of MB
HESSIAN_BUDGET_BYTES = 1 << 30  # all float64 Hessians together
MAX_FEEDS = 8  # observed samples whose model inputs are kept, spread over them, for empirical bias correction
FEED_BUDGET_BYTES = 256 << 20  # ... and at most this many bytes of them
SEED = 20240917


@dataclass(frozen=True)
class NodeInput:
    """Where one node's weight meets its data: the input tensor and how it is cut into patches."""

    node: str
    kind: WeightKind
    tensor: str
    geometry: Geometry
    trans_b: bool = False  # Gemm: the weight is stored [N, K]


@dataclass
class NodeInputs:
    """What the collector gathered: statistics per node, and why other nodes got none."""

    stats: dict[str, InputStats] = field(default_factory=dict)
    layouts: dict[str, NodeInput] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)  # the observed samples' model inputs


def node_input(node: onnx.NodeProto, weight: str, weight_shape: tuple[int, ...]) -> NodeInput | str:
    """How ``node`` reads its data input against ``weight`` (or why the algorithms cannot use it)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv" and node.input[1] == weight:
        return NodeInput(node.name, "Conv", node.input[0], ConvGeometry.from_attributes(attrs, weight_shape))
    if node.op_type == "Gemm" and node.input[1] == weight:
        axis = 0 if attrs.get("transA", 0) else -1
        return NodeInput(node.name, "Gemm", node.input[0], MatMulGeometry(axis), bool(attrs.get("transB", 0)))
    if node.op_type == "MatMul" and node.input[1] == weight:
        if len(weight_shape) != 2:
            return "its weight is a stack of matrices"
        return NodeInput(node.name, "MatMul", node.input[0], MatMulGeometry(-1))
    return f"{node.op_type} with this weight layout has no patch form"


def reduction_length(layout: NodeInput, weight_shape: tuple[int, ...]) -> tuple[int, int]:
    """(groups, K): how many Hessians the node has and the length of each."""
    if isinstance(layout.geometry, ConvGeometry):
        return layout.geometry.group, int(np.prod(weight_shape[1:]))
    return 1, int(weight_shape[1] if layout.trans_b else weight_shape[0])


@dataclass(frozen=True)
class PatchBudget:
    """How many patches a node's Hessian sums over a pass, and from how many samples.

    ``per_input`` patches per Hessian row, within the bounds; drawn from at most ``samples`` samples spread over the
    pass.
    """

    per_input: int = POSITIONS_PER_INPUT
    most: int = POSITIONS_PER_NODE
    least: int = MIN_POSITIONS
    samples: int = MAX_SAMPLES

    def of(self, k: int) -> int:
        """The patches of a node whose reduction is ``k`` long."""
        return min(self.most, max(self.least, self.per_input * k))


FULL_PATCHES = PatchBudget()  # what a config's weight algorithms get
# what the placement choice's rounding gets (qtool.choice.rounded): a quarter of the Hessian work of a large node, so
# that rounding a model whose storage-only misses the target costs little more than calibrating it did (the
# default's worst output on held-out samples: a MobileNetV3 orientation classifier 39.2 dB so, 36.1 dB with the full
# budget; the PP-OCR recogniser 26.8 dB so, 23.6 dB with the full one), drawn from twice the samples: the same
# Hessian work, more of the data seen (the PP-OCR detector 17.8 -> 25.1 dB, the audio front end 39.0 -> 52.2 dB,
# worst output on the evaluation files, for a float pass over 16 samples more)
LIGHT_PATCHES = PatchBudget(per_input=8, most=8192, least=1024, samples=32)


class NodeInputCollector:
    """Gathers :class:`InputStats` for chosen nodes from the batches of one float pass."""

    def __init__(
        self,
        layouts: Iterable[tuple[NodeInput, tuple[int, ...]]],
        samples: int = 1,
        means: bool = True,
        patches: PatchBudget = FULL_PATCHES,
    ) -> None:
        """Collect for ``layouts`` (each node's input layout and weight shape) over a pass of ``samples`` samples.

        ``means``: whether the mean patches are summed too (only bias correction reads them); ``patches``: how
        many patches each node's Hessian sums.
        """
        self.means, self.most_samples = means, patches.samples
        self.result = NodeInputs()
        self.positions: dict[str, int] = {}  # node -> patches its Hessian sums over the pass
        self.feed_bytes = 0
        self.looked_at = 0  # observed samples so far (for spreading the kept feeds)
        budget = HESSIAN_BUDGET_BYTES
        for layout, shape in layouts:
            groups, k = reduction_length(layout, shape)
            size = groups * k * k * 8
            if k > MAX_REDUCTION:
                self.result.skipped[layout.node] = f"its reduction of {k} inputs is longer than {MAX_REDUCTION}"
            elif size > budget:
                self.result.skipped[layout.node] = "the Hessians of earlier nodes used up the memory budget"
            else:
                budget -= size
                self.result.layouts[layout.node] = layout
                self.positions[layout.node] = patches.of(k)
        self.expect(samples)
        # Seeded by the node's name, not its place among the collected nodes: a node's patches (and so
        # its GPTQ codes) do not depend on which other nodes ask for inputs (tune measures all of them,
        # the config it writes asks for a few, and both must round each node alike).
        self.rngs = {name: np.random.default_rng([SEED, zlib.crc32(name.encode())]) for name in self.result.layouts}

    def expect(self, samples: int) -> None:
        """Spread the observed samples, and each node's patch budget, over a pass of ``samples`` samples."""
        self.every = max(1, math.ceil(samples / self.most_samples))  # observe one sample in this many
        self.observed = math.ceil(max(samples, 1) / self.every)
        self.feed_every = max(1, math.ceil(self.observed / MAX_FEEDS))  # keep one observed sample in this many
        self.seen = 0

    def _keep(self, feed: dict[str, np.ndarray], chosen: list[int], count: int) -> None:
        """Keep the chosen samples' model inputs, one feed per sample, while they fit the budget."""
        for i in chosen:
            self.looked_at += 1
            if (self.looked_at - 1) % self.feed_every or len(self.result.feeds) >= MAX_FEEDS:
                continue
            one = {k: (v[i : i + 1] if count > 1 and v.ndim and v.shape[0] == count else v) for k, v in feed.items()}
            size = sum(v.nbytes for v in one.values())
            if self.feed_bytes + size > FEED_BUDGET_BYTES:
                return
            self.feed_bytes += size
            self.result.feeds.append({k: np.array(v) for k, v in one.items()})

    @property
    def tensors(self) -> list[str]:
        """The node inputs the float pass must expose."""
        return list(dict.fromkeys(layout.tensor for layout in self.result.layouts.values()))

    def observe(
        self,
        values: dict[str, np.ndarray],
        count: int,
        feed: dict[str, np.ndarray] | None = None,
        rerun: Rerun | None = None,
    ) -> None:
        """Add one batch of ``count`` samples (``values``: at least :attr:`tensors`; ``feed``: the model inputs)."""
        first, self.seen = self.seen, self.seen + count
        chosen = [i for i in range(count) if (first + i) % self.every == 0]
        if not chosen:
            return
        if feed is not None:
            self._keep(feed, chosen, count)
        for name, layout in self.result.layouts.items():
            data = values[layout.tensor]
            if len(chosen) < count and data.ndim and data.shape[0] == count:
                data = data[chosen]
            per_sample = max(MIN_POSITIONS_PER_BATCH, math.ceil(self.positions[name] / self.observed))
            positions = per_sample * len(chosen)
            geometry, seed = layout.geometry, self.rngs[name]
            batch = input_stats(data, geometry, max_positions=positions, seed=seed, means=self.means, batch_sums=True)
            known = self.result.stats.get(name)
            self.result.stats[name] = batch.in_float64() if known is None else known.accumulated(batch)  # its own sums
