"""The pass protocol: a rewrite of the float model before calibration, deciding from the plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from qtool.options import CalibrationOptions
from qtool.pipeline.workspace import Transforms, Workspace


@dataclass(frozen=True)
class PassInputs:
    """What a pass may read besides the workspace."""

    data_dir: Path | str | None  # samples for the pass's own float pass (None: none were given)
    options: CalibrationOptions  # how those samples are read
    smoothing: dict[str, np.ndarray] | None = None  # SmoothQuant's channel maxima from a statistics file


@dataclass(frozen=True)
class PassResult:
    """The model a pass wrote (the same object when it changed nothing) and the record of what it did."""

    model: onnx.ModelProto
    transforms: Transforms


class Pass(Protocol):
    """One rewrite of ``workspace.prepared``; it reads which nodes to touch from ``workspace.plan()``."""

    name: str

    def requires(self, workspace: Workspace, inputs: PassInputs) -> None:
        """Refuse (QtoolError) inputs the pass cannot work with, before any pass of the list runs."""
        ...

    def apply(self, workspace: Workspace, inputs: PassInputs) -> PassResult:
        """The rewritten model and what was done (the workspace is not changed)."""
        ...


def check_passes(workspace: Workspace, passes: tuple[Pass, ...], inputs: PassInputs) -> None:
    """Check every pass's preconditions (QtoolError on the first refused), applying none."""
    for one in passes:
        one.requires(workspace, inputs)


def run_passes(workspace: Workspace, passes: tuple[Pass, ...], inputs: PassInputs) -> None:
    """Check every pass's preconditions, then apply ``passes`` in order, each to the model the one before wrote."""
    check_passes(workspace, passes, inputs)
    for one in passes:
        result = one.apply(workspace, inputs)
        workspace.transformed(result.model, result.transforms)
