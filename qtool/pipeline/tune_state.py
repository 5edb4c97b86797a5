"""What one tune run reads and shares between its steps: the request, the state, the outcome."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from qtool.calibration.dataset import Dataset
from qtool.choice.tune.candidates import Goal
from qtool.choice.tune.space import OPTIONS, W4, Option
from qtool.evaluation.scoring import OutputScorer
from qtool.evaluation.split import SampleSplit
from qtool.options import CalibrationOptions, TuneOptions
from qtool.pipeline.build import Builder
from qtool.pipeline.workspace import Workspace
from qtool.quantization.plan.records import NodePlan

FINAL_BUILD_SHARE = 1.5  # the final build (calibration again) is set aside as this many times the first one


@dataclass(frozen=True)
class TuneRequest:
    """What one ``tune`` run reads and writes."""

    model_path: Path
    output_path: Path
    config_out: Path
    data_dir: Path | str
    eval_dir: Path | str
    options: TuneOptions
    calibration: CalibrationOptions
    input_shapes: Mapping[str, Sequence[int]] | None
    goal: Goal


@dataclass
class Tuning:
    """The state every step of a tune run shares: the workspace, its builder, the nodes and the space."""

    request: TuneRequest
    ws: Workspace
    builder: Builder
    space: list[Option]
    tuned: list[NodePlan]  # nodes with a constant weight, largest first
    weight_shape: dict[str, list[int]]
    op_types: set[str]
    goal: Goal
    split: SampleSplit  # EVAL: the selection half chooses, the validation half judges the choice
    evaluation: OutputScorer  # all of EVAL's float outputs (the halves' scorers take theirs from it)
    spread: Dataset  # samples of the selection half each node is measured on
    opset: int  # the widest option's: every candidate is built at it
    started: float
    prepare_seconds: float  # calibration (and the GPTQ inputs): the final build does it again
    scoring_seconds: float = 0.0  # the longest build and scoring of one candidate on half of EVAL so far
    judged: frozenset[str] | None = None  # the outputs the goal judges (None: all; see qtool.evaluation.judged)
    state: dict[str, str] = field(default_factory=dict)  # state output -> its input: scored closed-loop

    @property
    def deadline(self) -> float:
        """When the search must stop: the budget less what the final build and its two scorings will take."""
        final = FINAL_BUILD_SHARE * self.prepare_seconds + 2 * self.scoring_seconds
        return self.started + self.request.options.time_budget - final

    def search_deadline(self) -> float:
        """When the search may start no more candidates: one more build and scoring must fit before :attr:`deadline`."""
        return self.deadline - self.scoring_seconds

    def scored(self, seconds: float) -> None:
        """Count one candidate's build and scoring (the estimate of what one more costs)."""
        self.scoring_seconds = max(self.scoring_seconds, seconds)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.tuned]

    @property
    def options(self) -> TuneOptions:
        return self.request.options

    def block_axes(self) -> dict[str, int | None]:
        """Each weighted node's per-block axis (the reduction axis), as the plan of per-block weights has it."""
        blocked = self.ws.config.with_rules(global_=W4.entry)
        return {n.name: n.weight.axis for n in self.ws.plan(blocked).every_node() if n.weight is not None}

    def build(self, allocation: Mapping[str, Option | str]) -> onnx.ModelProto:
        """The model of an allocation (node -> option): every tuned op type float, each node its option's rule."""
        rules = {}
        for node in sorted(allocation):
            option = allocation[node]
            settings = (OPTIONS[option] if isinstance(option, str) else option).settings
            if settings is not None:
                rules[node] = settings
        op_type = dict.fromkeys(sorted(self.op_types))
        return self.builder.build(self.ws.config.with_rules(op_type=op_type, node_name=rules, exclude=())).model
