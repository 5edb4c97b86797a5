"""The workspace: one model being quantized, and everything every stage reads about it, built once.

A :class:`Workspace` owns the model as read, the prepared (and transformed) model, its detached
weights, the validated config and the plans. Stages ask it for a plan instead of building one:
a plan is built once per distinct (model revision, config, tensor sizes) and reused, and a pass
that rewrites the model starts a new revision.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from qtool.calibration.statistics import CalibrationStats
from qtool.config import QConfig
from qtool.errors import QtoolError
from qtool.graph.checks import refuse_unknown_ops
from qtool.graph.index import GraphView, all_nodes
from qtool.graph.input_shapes import fix_input_shapes
from qtool.graph.model_io import load_model
from qtool.graph.opsets import choose_opset, runtime_qdq_limit
from qtool.graph.prepare import PrepareReport, default_opset, prepare_model, refuse_quantized
from qtool.graph.session import check_runtime_support
from qtool.graph.weights import Weights
from qtool.quantization.algorithms.transforms.smoothing_records import SmoothedGroup
from qtool.quantization.plan.planner import build_plan
from qtool.quantization.plan.records import QuantPlan
from qtool.quantization.plan.roles import static_elements
from qtool.results import ModelFile
from qtool.system.stages import stage

log = logging.getLogger(__name__)
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class Transforms:
    """What the pre-calibration passes did to the prepared model (reported, and checked against statistics)."""

    equalized: tuple[str, ...] = ()  # "first -> second" Conv pairs equalization rescaled
    smoothed: tuple[SmoothedGroup, ...] = ()  # what SmoothQuant did
    smoothing: dict[str, np.ndarray] = field(default_factory=dict)  # the channel maxima it smoothed with
    awq: tuple[SmoothedGroup, ...] = ()  # what AWQ did
    awq_notes: dict[str, str] = field(default_factory=dict)  # node -> why AWQ did not scale it

    def credit(self, algorithms: dict[str, list[str]], notes: dict[str, str]) -> None:
        """Name the passes that changed each node first among its ``algorithms``; AWQ's reasons go to ``notes``."""
        touched = [
            *(("equalization", node) for pair in self.equalized for node in pair.split(" -> ")),
            *(("smoothquant", node) for group in self.smoothed for node in group.nodes),
            *(("awq", node) for group in self.awq for node in group.nodes),
        ]
        for name, node in touched:
            algorithms.setdefault(node, []).insert(0, name)
        for node, why in self.awq_notes.items():
            notes.setdefault(node, why)


class Workspace:
    """One model being quantized: the prepared model, its weights, the config and the plans (memoized)."""

    def __init__(
        self,
        source: ModelFile,
        model: onnx.ModelProto,
        prepared: onnx.ModelProto,
        report: PrepareReport,
        weights: Weights,
        config: QConfig,
        original_inputs: tuple[onnx.ValueInfoProto, ...],
    ) -> None:
        self.source = source  # the input model as read: its digest ties statistics to it
        self.model = model  # as read (inputs fixed by --input-shapes): what the samples must feed
        self.prepared = prepared  # prepared, then rewritten by the passes: what gets quantized
        self.report = report
        self.weights = weights  # the values of the prepared model's large initializers
        self.config = config
        self.original_inputs = original_inputs  # the inputs as read, before --input-shapes
        self.transforms = Transforms()
        self.plans_built = 0  # how many plans were built (each distinct one once)
        self._revision = 0
        self._graph: GraphView | None = None  # the view of ``prepared`` at this revision
        self._plans: dict[tuple[int, str, tuple[tuple[str, int], ...] | None, frozenset[str] | None], QuantPlan] = {}
        self._finite: set[str] = set()  # weights checked finite

    @property
    def path(self) -> Path:
        return Path(self.source.path)

    @property
    def graph(self) -> GraphView:
        """The one graph view of the prepared model as it is now (built once per revision)."""
        if self._graph is None:
            self._graph = GraphView(self.prepared)
        return self._graph

    def plan(
        self,
        config: QConfig | None = None,
        elements: Mapping[str, int] | None = None,
        observed: frozenset[str] | None = None,
    ) -> QuantPlan:
        """The plan of ``config`` (the workspace's by default) for the model as it is now.

        ``elements`` (per-sample tensor sizes) let ``placement: auto`` decide; without them every
        auto node is planned integer, so calibration observes all it may need. ``observed``: the tensors
        calibration saw values of (a body it saw nothing of keeps float activations; None: unknown).
        """
        config = config if config is not None else self.config
        sizes = tuple(sorted(elements.items())) if elements is not None else None
        # the activation range rule changes the qparams, never the plan
        key = (self._revision, repr(replace(config, activation_ranges="observer")), sizes, observed)
        plan = self._plans.get(key)
        if plan is None:
            sizes_given = dict(elements) if elements is not None else None
            plan = build_plan(self.prepared, config, sizes_given, view=self.graph, observed=observed)
            self._check_weights(plan)
            self._plans[key] = plan
            self.plans_built += 1
        return plan

    def _check_weights(self, plan: QuantPlan) -> None:
        """Refuse a weight the plan quantizes that holds NaN or Inf, by name (before anything is calibrated).

        Weights mapped from external data are left to the rewrite (their range names them too): reading them
        all here would bring every page of a large model into memory at once.
        """
        for node in plan.nodes:
            if node.weight is None or node.weight.name in self._finite:
                continue
            init = self.graph.initializers.get(node.weight.name)
            if init is None or init.data_type not in _FLOATS or init.name in self.weights.regions:
                continue
            if not np.isfinite(self.weights.value(init)).all():
                raise QtoolError(
                    f"{self.path}: weight '{node.weight.name}' of node '{node.name}' holds NaN or Inf values: "
                    "it has no quantization range (and the float model computes NaN or Inf from it)",
                    hint="fix the weight in the model, or keep the node float with an exclude: rule in the config",
                )
            self._finite.add(node.weight.name)

    def sizes(self, stats: CalibrationStats | None = None) -> dict[str, int]:
        """Per-sample element counts: the static shapes, then what calibration saw."""
        return {**static_elements(self.prepared), **(stats.elements if stats is not None else {})}

    def transformed(self, model: onnx.ModelProto, transforms: Transforms) -> None:
        """Take a pass's rewritten model (a new revision: plans are built anew) and what it did."""
        if model is not self.prepared:
            self.prepared = model
            self._revision += 1
            self._graph = None
        self.transforms = transforms


def open_workspace(
    model_path: Path,
    config: QConfig,
    opset: int | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    at_least: tuple[int, str] | None = None,
) -> Workspace:
    """Load, check and prepare ``model_path`` for ``config`` (at ``opset``, or the one it needs).

    ``at_least``: an opset the caller needs beyond the config's (and why), the model's own kept when newer.
    """
    weights = Weights()
    with stage(f"load {model_path}"):
        model = load_model(model_path, weights)
    refuse_quantized(model, str(model_path))
    refuse_unknown_ops(model, str(model_path))
    original_inputs = tuple(_copied(value) for value in model.graph.input)
    if input_shapes:
        fix_input_shapes(model, input_shapes, str(model_path))
    limit = runtime_qdq_limit(*config.quantized_dtypes())
    required = max(config.opset_requirement(), at_least or (0, ""))
    target = choose_opset(default_opset(model), required, limit, opset, source=str(model_path))
    check_runtime_support(model, str(model_path), target)
    with stage("prepare the graph"):
        prepared, report = prepare_model(model, weights, target_opset=target, source=str(model_path))
    _check_node_patterns(config, [n.name for n in all_nodes(prepared.graph)], model_path)  # bodies too
    return Workspace(ModelFile.of(model_path), model, prepared, report, weights, config, original_inputs)


def _check_node_patterns(config: QConfig, node_names: list[str], model_path: Path) -> None:
    """A ``re:`` pattern that matches nothing is a warning (written for a family); an exact name, an error."""
    unmatched = config.unmatched_node_patterns(node_names)
    for pattern in (p for p in unmatched if p.startswith("re:")):
        log.warning("%s: pattern '%s' matches no node of %s", config.source, pattern, model_path)
    exact = [p for p in unmatched if not p.startswith("re:")]
    if exact:
        close = difflib.get_close_matches(exact[0], node_names, n=3)
        raise QtoolError(
            f"{config.source}: node name '{exact[0]}' matches no node of {model_path}",
            hint=f"closest node names: {', '.join(close)}" if close else f"run qtool inspect {model_path}",
        )


def _copied(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    return copy
