"""Output accuracy of candidate models on a few samples, against float outputs computed once.

The placement choice and the sensitivity search score many candidate models on the same
samples. The float model runs at most once per sample (not at all for samples whose outputs
calibration kept, see :mod:`qtool.calibration.outputs`) and its outputs are kept (up to
:data:`CACHED_BYTES`; beyond that they are recomputed per candidate), the samples' inputs are
read once, and each candidate only runs its outputs: no intermediate tensor is exposed.

A streaming model (``state``: its state outputs and the inputs they feed back) is scored as it runs
over data laid out as sequences (a sub-folder per sequence, its chunks in order, see
:mod:`qtool.evaluation.closed_loop`): each chunk after a sequence's first takes the state the same
model returned for the chunk before, the float model's own for the reference and the candidate's own
for the candidate, so a candidate whose error compounds through its state scores as it will run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from qtool.calibration.dataset import Dataset, Feed, continuations
from qtool.calibration.outputs import FloatOutputs
from qtool.evaluation.confidence import CONFIDENCE, SampleEnergies
from qtool.evaluation.metrics import ErrorAccumulator, is_float
from qtool.evaluation.output_parts import OutputPart, concat_layouts, scaled_parts
from qtool.evaluation.row_matching import matched_rows, selection_ordered
from qtool.graph.session import create_session, run_session
from qtool.graph.weights import Weights

CACHED_BYTES = 256 << 20  # float outputs kept across candidates; past this they are recomputed


@dataclass(frozen=True)
class OutputScore:
    """SQNR of each float output of a candidate on the scored samples."""

    outputs: dict[str, float]  # output name -> SQNR in dB (+inf: exact)
    energies: dict[str, SampleEnergies] = field(default_factory=dict)  # output name -> per-sample energies
    judged: frozenset[str] | None = None  # the outputs a target judges (None: all; see qtool.evaluation.judged)
    parents: Mapping[str, str] = field(default_factory=dict)  # a part (qtool.evaluation.output_parts) -> its output

    def judges(self, name: str) -> bool:
        """Whether the target judges output (or output part) ``name``."""
        return self.judged is None or self.parents.get(name, name) in self.judged

    @property
    def worst_db(self) -> float:
        """The lowest SQNR among the judged outputs (-inf when none was measured)."""
        return min((db for name, db in self.outputs.items() if self.judges(name)), default=-math.inf)

    def worst_bound_db(self, confidence: float = CONFIDENCE, signal_means: Mapping[str, float] | None = None) -> float:
        """The lowest of the judged outputs' lower confidence bounds (see :mod:`qtool.evaluation.confidence`).

        ``signal_means``: each output's mean float energy per sample over a larger set than the scored one.
        """
        means = signal_means or {}
        bounds = [
            e.lower_bound_db(confidence, means.get(name)) for name, e in self.energies.items() if self.judges(name)
        ]
        return min(bounds, default=self.worst_db)


def signal_means(scorers: Sequence[OutputScorer]) -> dict[str, float]:
    """Each float output's mean energy per sample over the samples of all ``scorers`` together."""
    pooled: dict[str, list[float]] = {}
    for scorer in scorers:
        for name, energies in scorer.signal.items():
            pooled.setdefault(name, []).extend(energies)
    return {name: float(np.mean(energies)) for name, energies in pooled.items() if energies}


class OutputScorer:
    """Scores candidate models on a fixed set of samples against the float model."""

    def __init__(
        self,
        reference: onnx.ModelProto,
        dataset: Dataset,
        *,
        threads: int | None = None,
        weights: Weights | None = None,
        on_sample: Callable[[int], None] | None = None,
        known: FloatOutputs | None = None,
        judged: frozenset[str] | None = None,
        state: Mapping[str, str] | None = None,
    ) -> None:
        self.threads = threads
        self.judged = judged  # the outputs a target judges (None: all)
        self.state = dict(state or {})  # state output -> the input it feeds back (closed loop over sequences)
        self.weights = weights
        self._reference_model = reference
        self.ordered = frozenset(selection_ordered(reference))  # outputs compared as sets of rows (row_matching)
        self._session: ort.InferenceSession | None = None  # created only when a float output must be computed
        self.samples: list[tuple[Path, Feed]] = list(dataset.samples())
        self.files = [path.name for path, _ in self.samples]
        self.names: list[str] = []
        self._cached: list[list[np.ndarray] | None] = []
        self.signal: dict[str, list[float]] = {}  # each float output's energy (and each part's), per sample
        self.parts: list[OutputPart] = []  # parts of outputs measured on their own too (qtool.evaluation.output_parts)
        # closed loop: whether each sample continues the one before, and the float model's own state it was fed
        self._follows = continuations(dataset.directory, [p for p, _ in self.samples]) if self.state else []
        self._fed: list[dict[str, np.ndarray]] = []
        every = [o.name for o in reference.graph.output]
        kept, carried = 0, dict[str, np.ndarray]()
        for index, (path, feed) in enumerate(self.samples):
            fed = carried if self._follows and self._follows[index] else {}
            self._fed.append(fed)
            known_values = known.get(path, every) if known is not None and not fed else None  # kept: open loop
            values = known_values or self._run_reference(path, {**feed, **fed}, every)
            carried = {self.state[n]: np.asarray(v) for n, v in zip(every, values, strict=True) if n in self.state}
            if not self.names:
                self.names = [n for n, v in zip(every, values, strict=True) if is_float(v)]
            floats = [np.asarray(v) for v, name in zip(values, every, strict=True) if name in self.names]
            if index == 0:
                self.parts = scaled_parts(concat_layouts(reference), dict(zip(self.names, floats, strict=True)))
            for name, value in zip(self.names, floats, strict=True):
                for key, view in self._views(name, value):
                    self.signal.setdefault(key, []).append(float(np.sum(np.square(view, dtype=np.float64))))
            size = sum(v.nbytes for v in floats)
            self._cached.append(floats if kept + size <= CACHED_BYTES else None)
            kept += size if kept + size <= CACHED_BYTES else 0
            if on_sample:
                on_sample(1)

    def _run_reference(self, path: Path, feed: Feed, names: list[str]) -> list[np.ndarray]:
        if self._session is None:
            self._session = create_session(
                self._reference_model, "the float model", threads=self.threads, weights=self.weights
            )
        return [np.asarray(v) for v in run_session(self._session, names, feed, f"the float model on {path}")]

    def _reference(self, index: int) -> list[np.ndarray]:
        cached = self._cached[index]
        if cached is not None:
            return cached
        path, feed = self.samples[index]
        return self._run_reference(path, {**feed, **self._fed[index]}, self.names)

    def per_sequence(self, score: OutputScore) -> dict[str, SampleEnergies] | None:
        """``score``'s judged energies summed over each sequence of 2+ chunks it ran closed-loop (None: none ran).

        The spread from one sequence to the next, not from one chunk to the next, is what a new sequence will see:
        the lower bound over new sequences reads these.
        """
        groups: list[list[int]] = []
        for index, follows in enumerate(self._follows):
            if follows:
                groups[-1].append(index)
            else:
                groups.append([index])
        groups = [group for group in groups if len(group) > 1]
        if not groups:
            return None
        return {
            name: SampleEnergies(
                tuple(sum(e.signal[i] for i in group) for group in groups),
                tuple(sum(e.noise[i] for i in group) for group in groups),
            )
            for name, e in score.energies.items()
            if score.judges(name)
        }

    def float_outputs(self) -> FloatOutputs:
        """The float outputs computed so far, by sample file (for another scorer over some of the same files)."""
        known = FloatOutputs()
        for (path, _), cached, fed in zip(self.samples, self._cached, self._fed, strict=True):
            if cached is not None and not fed:  # a chunk fed the state before it: not what its file alone gives
                known.add(path, dict(zip(self.names, cached, strict=True)))
        return known

    def release(self) -> None:
        """Free the float model's session (scoring later creates it again if needed)."""
        self._session = None

    def score(self, model: onnx.ModelProto, what: str = "the candidate model") -> OutputScore:
        """Run ``model`` (detached values from the scorer's weights) on the samples and compare its outputs."""
        session = create_session(model, what, threads=self.threads, weights=self.weights)
        return self.score_session(session, what)

    def reference_outputs(self, index: int) -> dict[str, np.ndarray]:
        """The float model's outputs on sample ``index``, by name."""
        return dict(zip(self.names, self._reference(index), strict=True))

    def score_session(
        self,
        session: ort.InferenceSession,
        what: str = "the candidate model",
        collect: list[dict[str, np.ndarray]] | None = None,
    ) -> OutputScore:
        """Like :meth:`score`, for a session already created; ``collect`` receives each sample's outputs."""
        measured_names = [*self.names, *(part.name for part in self.parts)]
        accumulators = {name: ErrorAccumulator() for name in measured_names}
        signal: dict[str, list[float]] = {name: [] for name in measured_names}
        noise: dict[str, list[float]] = {name: [] for name in measured_names}
        fetched = [*self.names, *(name for name in self.state if name not in self.names)]
        carried: dict[str, np.ndarray] = {}
        for index, (path, feed) in enumerate(self.samples):
            fed = {**feed, **carried} if self._follows and self._follows[index] else feed
            values = run_session(session, fetched, fed, f"{what} on {path}")
            carried = {self.state[n]: np.asarray(v) for n, v in zip(fetched, values, strict=True) if n in self.state}
            values = values[: len(self.names)]
            if collect is not None:
                collect.append({name: np.asarray(v) for name, v in zip(self.names, values, strict=True)})
            for name, r, c in zip(self.names, self._reference(index), values, strict=True):
                if np.shape(r) == np.shape(c):
                    c = matched_rows(r, np.asarray(c)) if name in self.ordered else np.asarray(c)
                    for (key, ref), (_, cand) in zip(self._views(name, r), self._views(name, c), strict=True):
                        one = ErrorAccumulator()
                        one.add(ref, cand)
                        accumulators[key].merge(one)
                        signal[key].append(one.sum_ref_sq)
                        noise[key].append(one.sum_err_sq)
        measured = [name for name, acc in accumulators.items() if acc.count]
        return OutputScore(
            {name: accumulators[name].metrics(name).sqnr_db for name in measured},
            {name: SampleEnergies(tuple(signal[name]), tuple(noise[name])) for name in measured},
            self.judged,
            {part.name: part.output for part in self.parts},
        )

    def _views(self, name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """Output ``name``'s value whole, then each of its parts measured on its own."""
        return [(name, value), *((p.name, p.of(value)) for p in self.parts if p.output == name)]
