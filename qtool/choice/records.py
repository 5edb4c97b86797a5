"""The placement choice's records: candidates, what was chosen and why, what it is measured on."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import onnx

from qtool.calibration.dataset import Dataset
from qtool.calibration.outputs import FloatOutputs
from qtool.choice.search import SearchResult
from qtool.choice.validated import Validation, ValidationRound
from qtool.config import QConfig
from qtool.evaluation.confidence import CONFIDENCE
from qtool.evaluation.scoring import OutputScorer
from qtool.graph.weights import Weights
from qtool.quantization.plan.records import QuantPlan
from qtool.schemas.reports.quantize import PlacementCandidate
from qtool.schemes import CandidateName

# A candidate must be more than 10 % faster to displace a more accurate one. The bar sits beyond what load on
# the other core does to a ratio (the sample CNN's all-integer model, 3-4 % faster than "auto" when the machine
# is quiet, timed up to 6 % faster with a busy neighbour: at 5 % it won 1 run in 5 of a full test run), so
# candidates within the timing noise of each other are ranked by accuracy and the same command writes the same
# placement. A 10 % gain is what a user notices; the faster placement is a `--config integer` away.
TIE = 0.10
# two-sided interval of the median ratio (one-sided 99.5 %), needs 8+ rounds: at 90 % (5 rounds) 9 early rounds could
# call a 3.5 % gain decisive (the sample CNN kept its all-integer placement in 1 run of 8 on a busy machine)
DECISIVE_CONFIDENCE = 0.99


class CandidateBuilder(Protocol):
    """Plans and rewrites the model of a config; ``keep``: remembered, so writing it later costs nothing."""

    def __call__(self, config: QConfig, /, keep: bool = True) -> tuple[QuantPlan, onnx.ModelProto]: ...


PlacementRound = ValidationRound[CandidateName]
"""A placement scored on the validation samples (its report reads the choice as the candidate)."""


@dataclass
class PlacementChoice:
    """What the placement choice measured and what it kept.

    Changed while the choice runs; its report (:class:`qtool.schemas.reports.quantize.PlacementChoiceReport`) is
    read from it under the same names, the properties included.
    """

    target_sqnr_db: float
    samples: list[str]  # the files scored, spread over the data
    threads: int
    candidates: list[PlacementCandidate]
    chosen: CandidateName
    reason: str
    fp32_ms: float | None = None
    timing_note: str = ""
    search: SearchResult | None = None
    search_note: str = ""  # why no search ran, when it could have
    rounding_note: str = ""  # storage-only's weights rounded by GPTQ, when it missed the target (qtool.choice.rounded)
    parts: list[str] = field(default_factory=list)  # output parts also scored on their own (evaluation.output_parts)
    times: dict[str, list[float]] = field(default_factory=dict, repr=False)  # seconds per run, fp32 included
    # each placement scored on the validation samples, in order (the kept one's is the last)
    validations: list[PlacementRound] = field(default_factory=list)
    confidence: float = CONFIDENCE  # of the validation bounds
    decode_bar: float | None = None  # decoders: the dynamic placement's decode agreement, which a kept one reaches
    decode_steps: bool = False  # each file was scored as a prefill and as the decode step after it
    # the activation range rule every candidate uses, and the all-integer placement's worst output under each rule
    activation_ranges: str = "observer"
    range_worst_db: dict[str, float] = field(default_factory=dict)
    judged_note: str = ""  # which outputs the target judged, when not all of them (see qtool.evaluation.judged)

    @property
    def validation(self) -> Validation | None:
        """The kept placement's validation (None: too few samples to hold any out)."""
        return next((r.validation for r in reversed(self.validations) if r.choice == self.chosen), None)

    @property
    def range_scores(self) -> dict[str, float]:
        """The finite ones of ``range_worst_db``, to the thousandth of a dB (as reported)."""
        return {rule: round(db, 3) for rule, db in self.range_worst_db.items() if math.isfinite(db)}

    def settle(self) -> None:
        """Once the choice is made: each candidate's speedup over fp32, and which one is chosen."""
        self.candidates = [
            c.model_copy(update={"speedup": self.speedup(c), "chosen": c.name == self.chosen}) for c in self.candidates
        ]

    @property
    def chosen_candidate(self) -> PlacementCandidate:
        return next(c for c in self.candidates if c.name == self.chosen)

    def speedup(self, candidate: PlacementCandidate) -> float | None:
        """fp32 median / the candidate's median (None when not timed)."""
        if candidate.latency_ms is None or self.fp32_ms is None or candidate.latency_ms <= 0:
            return None
        return self.fp32_ms / candidate.latency_ms

    @property
    def expects_speedup(self) -> bool:
        """Whether the kept placement measured faster than fp32 (untimed: whether it runs integer kernels).

        Storage-only can: the prepared graph runs faster than the file where it rewrote ops (hard activations).
        """
        chosen = self.chosen_candidate
        speedup = self.speedup(chosen)
        return chosen.integer_nodes > 0 if speedup is None else speedup > 1 + TIE


@dataclass(frozen=True)
class FloatModel:
    """The float model the candidates are measured against."""

    path: Path  # the file, timed as fp32 as ``compare`` times it
    prepared: onnx.ModelProto  # the prepared model the candidates were built from
    weights: Weights  # the detached values the models use
    elements: dict[str, int]  # per-sample element counts of tensors
    judged: frozenset[str] | None = None  # the outputs the target judges (None: all)
    state: dict[str, str] = field(default_factory=dict)  # state output -> its input (fed back over sequences)

    def scorer(self, dataset: Dataset, known: FloatOutputs | None, on_sample: Callable[[int], None]) -> OutputScorer:
        """Scores candidates on ``dataset`` against this model (``known``: float outputs calibration kept).

        A streaming model is scored closed-loop over sequences (see :mod:`qtool.evaluation.scoring`).
        """
        return OutputScorer(
            self.prepared,
            dataset,
            weights=self.weights,
            on_sample=on_sample,
            known=known,
            judged=self.judged,
            state=self.state,
        )


@dataclass(frozen=True)
class Samples:
    """The samples the choice reads."""

    scored: Dataset  # every candidate is scored on these (the selection samples)
    ranked: Dataset  # the search's per-layer pass
    known: FloatOutputs | None = None  # float outputs calibration kept (see :mod:`qtool.calibration.outputs`)
    validation: Dataset | None = None  # samples no candidate is scored on: the kept one is validated there
    # the data's own files behind ``scored`` and ``validation`` when those hold more (a decoder's decode steps)
    scored_files: list[str] | None = None
    validation_files: list[str] | None = None


def meets(sqnr: float, target: float) -> bool:
    """Whether an SQNR (NaN: never) reaches the target."""
    return not math.isnan(sqnr) and sqnr >= target
