"""Run the float model on onnxruntime with the plan's tensors exposed, and feed the observers.

The result, :class:`CalibrationStats`, is a versioned JSON document: the model's
fingerprint, the observer used and each observer's serialised state. Stats from
shards of a dataset merge exactly.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from qtool.calibration.dataset import Dataset, Feed, SequenceOrder, in_sequences
from qtool.calibration.outputs import FloatOutputs
from qtool.calibration.taps import BatchTap, Taps
from qtool.errors import QtoolError
from qtool.graph.branches import expose
from qtool.graph.session import create_session, run_session
from qtool.graph.weights import Weights
from qtool.observers import Observer, create_observer
from qtool.schemas.stats import STATS_FORMAT, STATS_VERSION, parse_stats
from qtool.system.files import read_json

log = logging.getLogger(__name__)

STATS_MAX_BYTES = 1 << 30  # a statistics file larger than this is not one qtool wrote

ProgressCallback = Callable[[int], None]  # called with the number of samples just processed


@dataclass
class CalibrationStats:
    """Observed statistics of every tensor the quantizer needs."""

    model_sha256: str
    observer: str
    samples: int
    tensors: dict[str, Observer]
    shard: str | None = None  # "K/N" for one shard of a dataset, None for a whole one
    skipped: int = 0  # samples left out for holding NaN/Inf
    elements: dict[str, int] = field(default_factory=dict)  # per-sample element count of each tensor
    smoothing: dict[str, np.ndarray] = field(default_factory=dict)  # SmoothQuant's channel abs maxima, per tensor
    equalized: list[str] = field(default_factory=list)  # "first -> second" pairs equalized before calibration

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": STATS_FORMAT,
            "version": STATS_VERSION,
            "model_sha256": self.model_sha256,
            "observer": self.observer,
            "samples": self.samples,
            "shard": self.shard,
            "skipped": self.skipped,
            "elements": dict(sorted(self.elements.items())),
            "smoothing": {name: [float(v) for v in values] for name, values in sorted(self.smoothing.items())},
            "equalized": list(self.equalized),
            "tensors": {
                name: {"observer": obs.reference, "axis": obs.axis, "options": obs.options(), "state": obs.state()}
                for name, obs in sorted(self.tensors.items())
            },
        }

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, exact float repr)."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str, trusted: frozenset[str] = frozenset()) -> CalibrationStats:
        """Rebuild stats from :meth:`to_dict` output; ``source`` names the file in errors.

        Every field is checked before use. A ``package.module:Class`` observer is imported only if it
        is in ``trusted`` (what the user named: --observer, the config) or ``QTOOL_OBSERVERS``.
        """
        document = parse_stats(data, source)
        tensors: dict[str, Observer] = {}
        for name, entry in document.tensors.items():
            try:
                observer = create_observer(
                    entry.observer, entry.axis, entry.options or {}, allow_import=entry.observer in trusted
                )
                if entry.state:
                    observer.load_state(entry.state)
                    # the whole file is checked when read, whatever the plan later uses (cheap: a histogram
                    # observer checks its extremes and histograms, not the range it would choose)
                    observer.check()
            except QtoolError as e:
                raise QtoolError(f"{source}: tensor {name!r}: {e.message}", hint=e.hint) from e
            except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
                raise QtoolError(f"{source}: tensor {name!r}: malformed statistics ({type(e).__name__}: {e})") from e
            tensors[name] = observer
        if tensors and document.samples == 0:
            raise QtoolError(f"{source} holds statistics of 0 samples", hint="re-run qtool calibrate on usable samples")
        return cls(
            document.model_sha256,
            document.observer,
            document.samples,
            tensors,
            document.shard,
            document.skipped,
            dict(document.elements),
            {name: np.asarray(values, np.float32) for name, values in document.smoothing.items()},
            list(document.equalized),
        )

    @classmethod
    def read(cls, path: Path | str, trusted: frozenset[str] = frozenset()) -> CalibrationStats:
        """Load stats written by :meth:`to_json` (``trusted``: see :meth:`from_dict`)."""
        return cls.from_dict(read_json(path, "statistics file", STATS_MAX_BYTES), str(path), trusted)

    @classmethod
    def merge_all(cls, parts: list[CalibrationStats]) -> CalibrationStats:
        """Merge the statistics of several shards (in any order) into one."""
        if not parts:
            raise QtoolError("nothing to merge")
        shards = [p.shard for p in parts if p.shard]
        if len(set(shards)) != len(shards):
            duplicate = next(s for s in shards if shards.count(s) > 1)
            raise QtoolError(f"shard {duplicate} is given twice", hint="merge each shard's statistics once")
        counts = {int(s.split("/")[1]) for s in shards}
        if shards and (len(counts) != 1 or len(shards) != next(iter(counts)) or len(shards) != len(parts)):
            log.warning("merging shards %s: not a complete set of K/N shards", ", ".join(shards))
        merged = parts[0]
        for part in parts[1:]:
            merged = merged.merge(part)
        return CalibrationStats(
            merged.model_sha256,
            merged.observer,
            merged.samples,
            merged.tensors,
            None,
            merged.skipped,
            merged.elements,
            merged.smoothing,
            merged.equalized,
        )

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Combine the statistics of two shards of one dataset into new stats."""
        if other.model_sha256 != self.model_sha256:
            raise QtoolError("cannot merge statistics of different models (model fingerprints differ)")
        if other.observer != self.observer:
            raise QtoolError(f"cannot merge statistics of observer '{other.observer}' into '{self.observer}'")
        if sorted(self.smoothing) != sorted(other.smoothing) or any(
            not np.array_equal(values, other.smoothing[name]) for name, values in self.smoothing.items()
        ):
            raise QtoolError("cannot merge statistics of differently smoothed models (SmoothQuant maxima differ)")
        if self.equalized != other.equalized:
            raise QtoolError("cannot merge statistics of differently equalized models (equalized pairs differ)")
        merged: dict[str, Observer] = {}
        for name in sorted(set(self.tensors) | set(other.tensors)):
            combined = (self.tensors.get(name) or other.tensors[name]).copy()
            if name in self.tensors and name in other.tensors:
                try:
                    combined.merge(other.tensors[name])
                    combined.check()
                except (ValueError, TypeError, IndexError) as e:  # e.g. shards with different channel counts
                    raise QtoolError(f"cannot merge the statistics of tensor {name!r}: {e}") from e
            merged[name] = combined
        return CalibrationStats(
            self.model_sha256,
            self.observer,
            self.samples + other.samples,
            merged,
            None,
            self.skipped + other.skipped,
            {**other.elements, **self.elements},
            self.smoothing,
            self.equalized,
        )


_NOTHING = np.zeros((0,), np.float32)  # what an observer of a tensor that cannot be exposed sees: nothing


def with_exposed_outputs(model: onnx.ModelProto, tensors: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs ``tensors`` (as float32; see :func:`exposing`)."""
    return exposing(model, list(tensors))[0]


def exposing(model: onnx.ModelProto, tensors: list[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of ``model`` that also outputs ``tensors``, and the name to fetch each under.

    A tensor inside an If branch comes out of its If (empty for a sample that runs the other branch), one in
    a Loop or Scan body stacked over its iterations (see :func:`qtool.graph.branches.expose`); one that cannot
    come out is left out of the names.
    """
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    return exposed, expose(exposed, tensors)


@dataclass(frozen=True)
class Observing:
    """Which observer watches each tensor: ``observer`` with ``options``, unless ``per_tensor`` names another."""

    observer: str
    options: dict[str, Any] = field(default_factory=dict)
    per_tensor: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class FloatPass:
    """How the float model runs over the samples."""

    batch_size: int = 1  # samples per inference when the batch dimension is dynamic
    threads: int | None = None  # onnxruntime's intra-op threads and the observing threads (None: every core)
    weights: Weights | None = None  # the values of the model's detached initializers
    # a streaming model's state outputs and the inputs they feed back: over data laid out as sequences, each
    # chunk after a sequence's first takes the state the float model returned for the chunk before (one at a time)
    state: tuple[tuple[str, str], ...] = ()


def _exposing_session(
    prepared: onnx.ModelProto, tensors: list[str], run: FloatPass, *, spinning: bool
) -> tuple[ort.InferenceSession, dict[str, str]]:
    """A session of ``prepared`` that also returns ``tensors``, and the name to fetch each under (:func:`exposing`).

    ``spinning`` False when the observers run on threads of their own: onnxruntime's idle workers would
    otherwise busy-wait through the observing between runs.
    """
    exposed, fetch = exposing(prepared, tensors)
    session = create_session(
        exposed,
        "the prepared float model",
        threads=run.threads,
        level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        weights=run.weights,
        spinning=spinning,
    )
    return session, fetch


def collect_statistics(
    prepared: onnx.ModelProto,
    tensors: Iterable[str],
    dataset: Dataset,
    observing: Observing,
    run: FloatPass = FloatPass(),
    *,
    on_progress: ProgressCallback | None = None,
    known: FloatOutputs | None = None,
    taps: Sequence[BatchTap] = (),
) -> tuple[dict[str, Observer], int, dict[str, int]]:
    """Run ``prepared`` over ``dataset`` and observe each tensor in ``tensors``.

    Only one batch of activations is alive at a time, whatever the dataset size. The observers of
    a batch run on all cores (see :class:`_BatchObserver`). With ``known``, the graph outputs of
    each sample run alone and not fed the state before it are kept there. Each of ``taps`` sees every
    batch of the tensors it names. A streaming model follows its own state (see :class:`_StateCarry`).

    Returns:
        The observers by tensor name, the number of samples seen, and each tensor's
        element count per sample (from the first batch).
    """
    names = list(dict.fromkeys(tensors))
    tapped = Taps(taps)
    if not names and not tapped.tensors:  # weight-only quantization: nothing to observe, and no reason to run the model
        return {}, len(dataset), {}
    default = (observing.observer, observing.options)
    specs = {name: observing.per_tensor.get(name, default) for name in names}
    observers = {name: create_observer(spec[0], None, spec[1]) for name, spec in specs.items()}
    observe = _BatchObserver([observers[name] for name in names], run.threads)
    try:
        session, fetch = _exposing_session(prepared, [*names, *tapped.tensors], run, spinning=observe.threads == 1)
        seen, elements = 0, dict[str, int]()
        graph_outputs = [o.name for o in prepared.graph.output] if known is not None else []
        carry = _StateCarry(dataset, run.state)
        fetched = list(dict.fromkeys([*fetch.values(), *graph_outputs, *carry.state]))
        tapped.run_on(session, fetch)
        for paths, given in dataset.batches(1 if carry.state else run.batch_size):
            count = len(paths)
            feed, fed = carry.feed(paths, given)
            fetched_values = run_session(session, fetched, feed, f"the float model on {_samples(paths)}")
            by_name = carry.kept(paths, dict(zip(fetched, fetched_values, strict=True)))
            if known is not None and count == 1 and not fed:
                known.add(paths[0], {name: np.asarray(by_name[name]) for name in graph_outputs})
            values = [np.asarray(by_name[fetch[name]]) if name in fetch else _NOTHING for name in names]
            tapped.observe(by_name, count, feed)
            del fetched_values, by_name
            observe(values)
            for name, value in zip(names, values, strict=True):
                if value.size:  # empty: an If branch this sample did not run
                    elements.setdefault(name, int(value.size) // count)
            del values  # drop this batch's activations before the next one is computed
            seen += count
            if on_progress:
                on_progress(count)
    finally:
        observe.close()
        if run.weights is not None:
            run.weights.release()  # the pass read every weight: the mapped ones go back to their file
    return observers, seen, elements


class _StateCarry:
    """A streaming model's state, carried from each chunk of a sequence to the next as it runs (``FloatPass.state``).

    Only data laid out as sequences (sub-folders) carries state, one chunk at a time; a flat folder keeps its
    batches, each sample with the state its file holds.
    """

    def __init__(self, dataset: Dataset, state: Sequence[tuple[str, str]]) -> None:
        self.state = dict(state) if in_sequences(dataset.directory, dataset.files) else {}
        self.order = SequenceOrder(dataset.directory)
        self.before: Path | None = None
        self.carried: dict[str, np.ndarray] = {}

    def feed(self, paths: list[Path], feed: Feed) -> tuple[Feed, bool]:
        """The feed of a batch: a chunk that continues the one before takes its state; and whether it did."""
        fed = bool(self.state) and self.order.follows(paths[0], self.before)
        return ({**feed, **self.carried}, True) if fed else (feed, False)

    def kept(self, paths: list[Path], values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``values`` (a run's outputs by name), their state kept for the chunk after."""
        self.before = paths[0]
        self.carried = {self.state[out]: np.asarray(values[out]) for out in self.state}
        return values


def _samples(paths: Sequence[Path]) -> str:
    """The sample files of one batch, for an error message."""
    if len(paths) == 1:
        return f"sample {paths[0]}"
    return f"the batch of samples {paths[0]} ... {paths[-1]} ({len(paths)} samples)"


MAX_OBSERVER_THREADS = 8  # observing is bounded by memory bandwidth well before this


def _cores() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class _BatchObserver:
    """Shows each observer its tensor of a batch, on every core when the observers allow it.

    Observers are split once into one group per thread, balanced by tensor size; each group is
    observed in order by one thread, and a batch is finished before the next one is computed. An
    observer thus sees the same batches in the same order as in one thread: the statistics do
    not depend on the number of threads. Only observers whose class says ``concurrent`` take part.
    """

    def __init__(self, observers: Sequence[Observer], threads: int | None = None) -> None:
        self.observers = list(observers)
        parallel = all(type(o).concurrent for o in self.observers)
        cap = min(_cores(), threads or MAX_OBSERVER_THREADS, MAX_OBSERVER_THREADS)
        self.threads = min(cap, len(self.observers)) if parallel else 1
        self.pool = ThreadPoolExecutor(self.threads - 1, "qtool-observe") if self.threads > 1 else None
        self.groups: list[list[int]] | None = None

    def __call__(self, values: list[np.ndarray]) -> None:
        if self.pool is None:
            for observer, value in zip(self.observers, values, strict=True):
                observer.observe(value)
            return
        if self.groups is None:  # sizes of the first batch: later batches have the same shapes, or nearly
            self.groups = [[] for _ in range(self.threads)]
            by_size = sorted(range(len(values)), key=lambda i: -values[i].size)
            for rank, index in enumerate(by_size):  # largest first, dealt out like cards: balanced
                self.groups[rank % self.threads].append(index)
        pending = [self.pool.submit(self._observe, group, values) for group in self.groups[1:]]
        self._observe(self.groups[0], values)
        for future in pending:
            future.result()

    def _observe(self, group: list[int], values: list[np.ndarray]) -> None:
        for index in group:
            self.observers[index].observe(values[index])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
