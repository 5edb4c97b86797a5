"""``qtool inspect --json``: per-node decisions and the predicted size, as pydantic models."""

from __future__ import annotations

from pydantic import Field

from qtool.schemas.reports.base import _Record, _Report
from qtool.schemas.reports.quantize import Prepare
from qtool.schemes import NodeKind


class InspectedModel(_Report):
    """The float model inspected."""

    path: str
    bytes: int


class InspectedNode(_Record):
    """What quantize would do to one node."""

    name: str
    op_type: str
    rule: str = Field(description="the config rule that decided the node's settings")
    weight: str = Field(description='e.g. "int4 per_block(32) sym", or "-" without a constant weight')
    activation: str = Field(description='e.g. "uint8 per_tensor asym", or "float" for weight-only nodes')
    weight_elements: int
    float_bytes: int
    quantized_bytes: int
    placement: NodeKind = Field(description="integer | dynamic | storage | weight_only | lookup | chained")
    placement_reason: str
    predicted_kernel: str = Field(description='the kernel onnxruntime is predicted to run, e.g. "QLinearConv"')
    integer_kernel: bool
    kernel_reason: str
    algorithms: list[str]
    weight_form: str = Field(
        description="integer nodes: how the 8-bit weight is stored against AVX2 pair saturation ('int8', 'int8 fitted: "
        "N/M channels, B bits', 'uint8' ...; see weight.saturation), '' for other nodes"
    )


class KeptFloat(_Report):
    """A node left in float, and why."""

    node: str
    op_type: str
    reason: str


class InspectTotals(_Report):
    """Sums over the planned nodes, and the predicted size of the quantized model."""

    weight_elements: int
    float_bytes: int
    quantized_bytes: int
    predicted_model_bytes: int = Field(description="exact up to scale values: the rewrite is done with placeholders")
    predicted_compression_ratio: float


class InspectReport(_Report):
    """``qtool inspect --json``: the plan quantize would follow, node by node."""

    schema_version: int
    qtool_version: str
    model: InspectedModel
    nodes: list[InspectedNode]
    kept_float: list[KeptFloat]
    passthrough_ops: dict[str, int]
    placement_note: str  # how quantize decides the placement shown ("" when its rules alone decide)
    totals: InspectTotals
    prepare: Prepare | None = Field(None, description="what graph preparation changed, as quantize reports it")
