"""Config -> plan -> quantized model, for one workspace and its statistics, memoized.

The placement choice builds several candidates and then writes one of them: a :class:`Builder`
keeps what it built by plan, so the winner is not rewritten again, and keeps the measured bias
shifts by plan and activation ranges, so no layer is measured twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qtool.calibration.statistics import CalibrationStats
from qtool.config import QConfig
from qtool.options import CalibrationOptions
from qtool.pipeline.data import tapped_pass
from qtool.pipeline.workspace import Workspace
from qtool.quantization.algorithms.rounding.empirical_bias import measure_shifts, measured_layers
from qtool.quantization.algorithms.rounding.node_inputs import (
    FULL_PATCHES,
    LIGHT_PATCHES,
    NodeInput,
    NodeInputCollector,
    PatchBudget,
    node_input,
)
from qtool.quantization.algorithms.rounding.weight_rounding import WeightAlgorithms
from qtool.quantization.emit.report import RewriteReport
from qtool.quantization.emit.rewrite import insert_qdq
from qtool.quantization.plan.activations import plan_activation_qparams
from qtool.quantization.plan.records import QuantPlan

log = logging.getLogger(__name__)

NEED_DATA = ("gptq", "adaround", "bias_correction")  # weight algorithms that need calibration inputs


@dataclass(frozen=True)
class Built:
    """One quantized model in memory, the plan it follows and what the rewrite reports."""

    plan: QuantPlan
    model: onnx.ModelProto
    report: RewriteReport


InputSource = Callable[[QConfig, frozenset[Path]], WeightAlgorithms | None]
"""Reads what a config's weight algorithms need from the data, in a pass of its own that leaves out the given files
(resolved paths: the samples a choice validates on); None: nothing to read."""


class Builder:
    """Builds the quantized model of a config over one workspace and its statistics.

    ``inputs``: where the weight algorithms' inputs come from when calibration did not collect them (the
    placement choice may round a candidate's weights by GPTQ): read once, the first time a config asks, from
    samples other than ``held_out`` (the choice's validation samples: what is validated there never saw them).
    """

    def __init__(
        self,
        ws: Workspace,
        stats: CalibrationStats,
        algorithms: WeightAlgorithms | None = None,
        inputs: InputSource | None = None,
    ) -> None:
        self.ws = ws
        self.stats = stats
        self.algorithms = algorithms
        self.inputs = inputs
        self.held_out: frozenset[Path] = frozenset()
        self.elements = ws.sizes(stats)  # with tensor sizes known, placement "auto" decides per node
        self.observed = frozenset(stats.elements)  # a body calibration saw nothing of keeps float activations
        self._built: dict[str, Built] = {}

    def plan(self, config: QConfig) -> QuantPlan:
        """The plan of ``config`` with the calibrated tensor sizes."""
        return self.ws.plan(config, self.elements, self.observed)

    def build(self, config: QConfig, *, keep: bool = False) -> Built:
        """The model of ``config``; with ``keep``, remembered so that a later build of its plan is free."""
        plan = self.plan(config)
        if self.algorithms is None and self.inputs is not None and _needs_inputs(plan):
            self.algorithms, self.inputs = self.inputs(config, self.held_out), None
        key = repr((plan.every_node(), plan.every_stored_weight(), config.activation_ranges))
        if key in self._built:
            return self._built.pop(key)
        built = self._rewrite(plan, config.activation_ranges)
        if keep:
            self._built[key] = built
        return built

    def forget(self) -> None:
        """Drop the remembered models."""
        self._built.clear()

    def _rewrite(self, plan: QuantPlan, ranges: str) -> Built:
        ws, algorithms = self.ws, self.algorithms
        act_qparams = plan_activation_qparams(plan, self.stats.tensors, ranges)
        wanted = {} if algorithms is None else empirical_bias_nodes(plan, algorithms)
        if not wanted:
            model, report = insert_qdq(ws.prepared, plan, act_qparams, ws.weights, algorithms)
            return Built(plan, model, report)
        assert algorithms is not None  # wanted is empty without it
        # Bias correction measures each layer's own mean error on the model as rounded, then corrects it.
        key = repr((plan.nodes, sorted((t, repr(q)) for t, q in act_qparams.items())))
        if key not in algorithms.shifts:
            rounded, _ = insert_qdq(ws.prepared, plan, act_qparams, ws.weights, algorithms, correct_biases=False)
            layers, skipped = measured_layers(rounded, ws.graph, ws.weights, wanted)
            shifts, few = measure_shifts(rounded, ws.weights, layers, algorithms.inputs.feeds)
            algorithms.shifts[key] = (shifts, {**skipped, **few})
        shifts, skipped = algorithms.shifts[key]
        measured: dict[str, np.ndarray | None] = {**dict.fromkeys(wanted), **shifts}
        model, report = insert_qdq(ws.prepared, plan, act_qparams, ws.weights, algorithms, measured)
        for node, reason in skipped.items():
            report.algorithm_notes.setdefault(node, f"bias_correction: {reason}")
        return Built(plan, model, report)


def _needs_inputs(plan: QuantPlan) -> bool:
    return any(n.weight is not None and n.scheme.algorithms.need_inputs for n in plan.every_node())


def data_inputs(ws: Workspace, data_dir: Path | str, calibration: CalibrationOptions) -> InputSource:
    """An :data:`InputSource` reading a config's weight algorithms' inputs in one float pass over ``data_dir``."""

    def read(config: QConfig, held_out: frozenset[Path]) -> WeightAlgorithms | None:
        collector = input_collector(ws, config, LIGHT_PATCHES)
        if collector is None:
            return None
        # the collector observes at most its budget's samples spread over a pass: the pass runs only those
        samples = LIGHT_PATCHES.samples
        tapped_pass(ws, data_dir, calibration, [collector], "what the weight rounding reads", samples, held_out)
        return WeightAlgorithms(collector.result)

    return read


def empirical_bias_nodes(plan: QuantPlan, algorithms: WeightAlgorithms) -> dict[str, NodeInput]:
    """Plan nodes whose bias correction is measured on the quantized model (needs the kept samples).

    Only nodes whose inputs are quantized: their output mean also drifts with the rounded input, which
    only a run of the quantized model shows. A node with float inputs (weight-only, storage) drifts by
    its rounded weight alone, which the analytic correction cancels exactly from the float input means,
    without a model run (so each node's correction is the same in every plan: tune relies on it).
    """
    if not algorithms.inputs.feeds:
        return {}
    return {
        node.name: algorithms.inputs.layouts[node.name]
        for node in plan.nodes
        if node.scheme.algorithms.bias_correction and node.name in algorithms.inputs.layouts and node.quantized_inputs
    }


def input_collector(
    ws: Workspace, config: QConfig | None = None, patches: PatchBudget = FULL_PATCHES
) -> NodeInputCollector | None:
    """A collector of the calibration inputs that the config's weight algorithms need (None: none do)."""
    plan = ws.plan(config)
    inits, nodes = ws.graph.every_initializer, ws.graph.by_name
    layouts = []
    skipped = {}
    means = False  # only bias correction reads the mean patches
    for node in plan.nodes:
        if node.weight is None or not node.scheme.algorithms.need_inputs:
            continue
        means = means or node.scheme.algorithms.bias_correction
        if node.placement == "lookup":
            skipped[node.name] = "a table lookup has no inputs to weigh its rounding errors by"
            continue
        shape = tuple(int(d) for d in inits[node.weight.name].dims)
        layout = node_input(nodes[node.name], node.weight.name, shape)
        if isinstance(layout, str):
            skipped[node.name] = layout
        else:
            layouts.append((layout, shape))
    if not layouts and not skipped:
        return None
    collector = NodeInputCollector(layouts, means=means, patches=patches)
    collector.result.skipped.update(skipped)
    return collector


def weight_algorithms(
    ws: Workspace, collector: NodeInputCollector | None, fed: bool
) -> tuple[WeightAlgorithms | None, str | None]:
    """The weight algorithms' inputs, when a float pass ``fed`` the collector (calibration's, or the search samples').

    Returns them (None when no node asks for an algorithm) and a note when they could not be had.
    """
    if collector is None:
        return None, None
    if not fed:
        plan = ws.plan()
        asked = sorted({name for n in plan.nodes for name in n.scheme.algorithms.names() if name in NEED_DATA})
        note = (
            f"{', '.join(asked)} need calibration samples: give --data (or --search-data with --stats); "
            "weights were rounded to nearest"
        )
        log.warning(note)
        return None, note
    return WeightAlgorithms(collector.result), None
