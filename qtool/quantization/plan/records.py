"""The plan's records: what each node, weight and activation becomes (built by :mod:`.planner`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from qtool.graph.branches import Branch
from qtool.quantization.plan.roles import CHAIN_OPS
from qtool.schemes import NodeKind, NodePlacement, NodeScheme, TensorScheme

# x86 CPUs without VNNI (AVX2; AVX-512 before Cascade Lake; AMD before Zen 4) multiply 8-bit activations
# by int8 weights with VPMADDUBSW, which adds two products in int16 and saturates: 255 x 127 x 2
# overflows. onnxruntime runs such kernels for integer-placed nodes with these activation dtypes.
U8S8_ACTIVATIONS = ("uint8", "int8")


@dataclass(frozen=True)
class WeightPlan:
    """A constant weight input: its initializer and where its scales lie.

    ``axis`` None means one scale for the tensor; with ``block_size`` None it is
    one scale per slice along ``axis`` (per channel), otherwise one per block of
    ``block_size`` elements along ``axis``.
    """

    name: str
    axis: int | None
    block_size: int | None = None


# the dtypes a StoredWeightPlan's weight may take (float16/fp8 ones stay float there)
STORED_DTYPES = ("int8", "uint8", "int4", "uint4", "int2", "uint2")


@dataclass(frozen=True)
class StoredWeightPlan:
    """A constant weight stored quantized and restored at load, read in float by a node with no integer kernel.

    Either a weight read inside an If/Loop/Scan body (:mod:`.bodies`), or a recurrent op's (LSTM, GRU,
    RNN) input or recurrence weight in the graph itself (:mod:`.recurrent`): then ``body`` is empty and
    ``owner`` and ``node`` both name the recurrent node.
    """

    owner: str  # the main-graph If/Loop/Scan node whose body (at any depth) reads it; or the recurrent node
    body: str  # the body's attribute (then_branch, else_branch, body), nested ones joined by '/'; "" for none
    node: str  # the node that reads it as its weight (inside the body, or the recurrent node)
    op_type: str
    weight: str
    scheme: TensorScheme
    axis: int | None  # the output-channel axis of per-channel scales (None: one scale)
    rule: str  # the config rule that decided it


@dataclass(frozen=True)
class NodePlan:
    """How one node is quantized."""

    name: str
    op_type: str
    scheme: NodeScheme
    activations: tuple[str, ...]  # float inputs quantized per tensor
    weight: WeightPlan | None
    bias: str | None  # 1-D initializer quantized to int32 (needs activations[0] and weight)
    output: str | None  # tensor quantized after the node (after a folded Relu)
    placement: NodePlacement = "integer"
    reason: str = ""  # why this placement
    macs: int | None = None  # multiply-accumulates per sample (integer nodes, when sizes are known)
    pair_layout: str | None = None  # how the integer kernel pairs the weight (qtool.numerics.saturation)

    @property
    def chained(self) -> bool:
        """An unweighted op between integer kernels (see :mod:`qtool.quantization.plan.chains`)."""
        return self.weight is None and self.op_type in CHAIN_OPS

    @property
    def kind(self) -> NodeKind:
        """How it runs, for counts: its placement, or "chained" for an op between integer kernels."""
        return "chained" if self.chained else self.placement

    @property
    def quantized_inputs(self) -> bool:
        """Whether the node's inputs are quantized (integer kernels, or quantized at run time)."""
        return self.placement == "dynamic" or (self.placement == "integer" and bool(self.activations))

    @property
    def fits_weight_pairs(self) -> bool:
        """Whether the int8 weight is fitted to the kernel's pair limit (``weight.saturation: auto``)."""
        return (
            self.quantized_inputs
            and self.scheme.weight.saturation == "fit"
            and self.scheme.weight.dtype == "int8"
            and self.scheme.activation.dtype in U8S8_ACTIVATIONS
            and self.pair_layout is not None
        )

    @property
    def reduced_weight_range(self) -> bool:
        """Whether the int8 weight is stored in [-64, 63] (``weight.saturation``; see :func:`guard_saturation`)."""
        return (
            self.quantized_inputs
            and self.scheme.weight.dtype == "int8"
            and self.scheme.activation.dtype in U8S8_ACTIVATIONS
            and (
                self.scheme.weight.saturation == "reduce_range"
                or (self.scheme.weight.saturation == "uint8" and self.scheme.activation.dtype == "int8")
            )
        )


@dataclass(frozen=True)
class QuantPlan:
    """Every quantization decision for one model."""

    nodes: tuple[NodePlan, ...]
    activations: dict[str, TensorScheme]  # tensor -> scheme, in first-use order
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (node, reason) left in float
    target: str = "cpu"  # the config's target (see qtool.config.for_target)
    # a pass-through op's output -> the input whose scale and zero point it takes (see qtool.quantization.plan.chains)
    shared: dict[str, str] = field(default_factory=dict)
    body_weights: tuple[StoredWeightPlan, ...] = ()  # weights inside If/Loop/Scan bodies, stored quantized
    # the main graph's If branches and Loop/Scan bodies, each planned as a model of its own
    branches: tuple[BranchPlan, ...] = ()
    recurrent_weights: tuple[StoredWeightPlan, ...] = ()  # LSTM/GRU/RNN weights, stored quantized
    # a quantized tensor a Clip writes -> the Clip's upper bound, which the tensor's grid must not pass (then
    # onnxruntime drops a ReLU6 before its quantizer, see qtool.quantization.plan.roles.folds_into_quantizer)
    ceilings: dict[str, float] = field(default_factory=dict)

    def every_branch(self) -> tuple[BranchPlan, ...]:
        """The plans of this plan's bodies and of the bodies nested in them."""
        return tuple(b for branch in self.branches for b in (branch, *branch.plan.every_branch()))

    def every_activation(self) -> dict[str, TensorScheme]:
        """The activations of this plan and of its bodies' plans (at any depth): all that needs a range."""
        found = dict(self.activations)
        for branch in self.every_branch():
            for tensor, scheme in branch.plan.activations.items():
                found.setdefault(tensor, scheme)
        return found

    def every_node(self) -> tuple[NodePlan, ...]:
        """The nodes of this plan and of its bodies' plans (at any depth)."""
        return (*self.nodes, *(n for branch in self.every_branch() for n in branch.plan.nodes))

    def stored_weights(self) -> tuple[StoredWeightPlan, ...]:
        """The weights stored for nodes that compute in float: in bodies, and of recurrent nodes."""
        return (*self.body_weights, *self.recurrent_weights)

    def every_stored_weight(self) -> tuple[StoredWeightPlan, ...]:
        """:meth:`stored_weights` of this plan and of its bodies' plans (at any depth)."""
        return tuple(w for plan in (self, *(b.plan for b in self.every_branch())) for w in plan.stored_weights())

    def recurrent_nodes(self) -> tuple[str, ...]:
        """The recurrent nodes (LSTM/GRU/RNN) whose weights are stored, here and in the bodies' plans."""
        return tuple(dict.fromkeys(w.owner for w in self.every_stored_weight() if not w.body))


@dataclass(frozen=True)
class BranchPlan:
    """One If branch or Loop/Scan body, planned as a model (see :mod:`qtool.graph.branches`)."""

    branch: Branch
    plan: QuantPlan
    observed: bool = True  # False: calibration saw none of its values, so its nodes keep float activations
    model: onnx.ModelProto = field(default_factory=onnx.ModelProto, repr=False, compare=False)  # the body as a model
    owned: tuple[str, ...] = ()  # the main graph's constants only this body reads: moved into it
