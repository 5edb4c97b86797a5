"""Run the float model on onnxruntime with the plan's tensors exposed, and feed the observers.

The result, :class:`CalibrationStats`, is a versioned JSON document: the model's
fingerprint, the observer used and each observer's serialised state. Stats from
shards of a dataset merge exactly.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qtool.dataset import Dataset
from qtool.errors import QtoolError
from qtool.files import read_json
from qtool.observers import Observer, create_observer
from qtool.runtime import create_session, run_session
from qtool.weights import Weights

log = logging.getLogger(__name__)

STATS_FORMAT = "qtool-calibration-stats"
STATS_VERSION = 1
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
        if not isinstance(data, dict) or data.get("format") != STATS_FORMAT:
            raise QtoolError(f"{source} is not a qtool statistics file (missing format '{STATS_FORMAT}')")
        if data.get("version") != STATS_VERSION:
            raise QtoolError(
                f"{source}: unsupported statistics version {data.get('version')!r}",
                hint=f"this qtool reads version {STATS_VERSION}; re-run qtool calibrate",
            )
        _check_fields(data, source)
        tensors: dict[str, Observer] = {}
        for name, entry in data["tensors"].items():
            try:
                observer = create_observer(
                    entry["observer"], entry["axis"], entry["options"] or {}, allow_import=entry["observer"] in trusted
                )
                if entry["state"]:
                    observer.load_state(entry["state"])
                    observer.check()
            except QtoolError as e:
                raise QtoolError(f"{source}: tensor {name!r}: {e.message}", hint=e.hint) from e
            except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
                raise QtoolError(f"{source}: tensor {name!r}: malformed statistics ({type(e).__name__}: {e})") from e
            tensors[name] = observer
        if tensors and data["samples"] == 0:
            raise QtoolError(f"{source} holds statistics of 0 samples", hint="re-run qtool calibrate on usable samples")
        return cls(
            data["model_sha256"],
            data["observer"],
            data["samples"],
            tensors,
            data["shard"],
            data["skipped"],
            dict(data["elements"]),
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
            merged.model_sha256, merged.observer, merged.samples, merged.tensors, None, merged.skipped, merged.elements
        )

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """Combine the statistics of two shards of one dataset into new stats."""
        if other.model_sha256 != self.model_sha256:
            raise QtoolError("cannot merge statistics of different models (model fingerprints differ)")
        if other.observer != self.observer:
            raise QtoolError(f"cannot merge statistics of observer '{other.observer}' into '{self.observer}'")
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
        )


def _check_fields(data: dict[str, Any], source: str) -> None:
    """The statistics file's fields, with their types and ranges, before anything uses them."""

    def bad(field: str, expected: str) -> QtoolError:
        return QtoolError(f"{source}: field '{field}' must be {expected}, got {data.get(field)!r:.80}")

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not (isinstance(data.get("model_sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", data["model_sha256"])):
        raise bad("model_sha256", "a SHA-256 hex digest")
    if not isinstance(data.get("observer"), str):
        raise bad("observer", "an observer name")
    if not count(data.get("samples")):
        raise bad("samples", "a count")
    data.setdefault("skipped", 0)
    if not count(data["skipped"]):
        raise bad("skipped", "a count")
    data.setdefault("shard", None)
    shard = data["shard"]
    if shard is not None and not (
        isinstance(shard, str)
        and (m := re.fullmatch(r"([0-9]{1,9})/([0-9]{1,9})", shard))
        and 1 <= int(m[1]) <= int(m[2])
    ):
        raise bad("shard", "null or 'K/N' with 1 <= K <= N")
    data["elements"] = data.get("elements") or {}
    if not (isinstance(data["elements"], dict) and all(count(v) for v in data["elements"].values())):
        raise bad("elements", "a mapping of tensor names to counts")
    tensors = data.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("tensors", "a mapping of tensor names to observer entries")
    for name, entry in tensors.items():
        where = f"{source}: tensor {name!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("observer"), str):
            raise QtoolError(f"{where}: expected an entry with 'observer', 'axis', 'options' and 'state'")
        entry.setdefault("axis", None)
        entry.setdefault("options", None)
        entry.setdefault("state", None)
        axis = entry["axis"]
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool) or not -64 <= axis < 64):
            raise QtoolError(f"{where}: 'axis' must be null or a small integer, got {axis!r:.40}")
        for key in ("options", "state"):
            if entry[key] is not None and not isinstance(entry[key], dict):
                raise QtoolError(f"{where}: '{key}' must be a mapping, got {type(entry[key]).__name__}")


def with_exposed_outputs(model: onnx.ModelProto, tensors: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs ``tensors`` (as float32)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output}
    for name in tensors:
        if name not in present:
            exposed.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
            present.add(name)
    return exposed


def collect_statistics(
    prepared: onnx.ModelProto,
    tensors: Iterable[str],
    dataset: Dataset,
    *,
    observer: str,
    options: dict[str, Any] | None = None,
    per_tensor: dict[str, tuple[str, dict[str, Any]]] | None = None,
    batch_size: int = 1,
    on_progress: ProgressCallback | None = None,
    weights: Weights | None = None,
) -> tuple[dict[str, Observer], int, dict[str, int]]:
    """Run ``prepared`` over ``dataset`` and observe each tensor in ``tensors``.

    Only one batch of activations is alive at a time, whatever the dataset size.

    Returns:
        The observers by tensor name, the number of samples seen, and each tensor's
        element count per sample (from the first batch).
    """
    names = list(dict.fromkeys(tensors))
    if not names:  # weight-only quantization: nothing to observe, and no reason to run the model
        return {}, len(dataset), {}
    default = (observer, options or {})
    specs = {name: (per_tensor or {}).get(name, default) for name in names}
    observers = {name: create_observer(spec[0], None, spec[1]) for name, spec in specs.items()}
    session = create_session(
        with_exposed_outputs(prepared, names),
        "the prepared float model",
        level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        weights=weights,
    )
    seen = 0
    elements: dict[str, int] = {}
    for count, feed in dataset.batches(batch_size):
        values = run_session(session, names, feed, f"the float model on samples of {dataset.directory}")
        for name, value in zip(names, values, strict=True):
            observers[name].observe(np.asarray(value))
            elements.setdefault(name, int(np.asarray(value).size) // count)
        del values  # drop this batch's activations before the next one is computed
        seen += count
        if on_progress:
            on_progress(count)
    return observers, seen, elements
