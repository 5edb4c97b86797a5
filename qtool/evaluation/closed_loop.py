"""Streaming models evaluated as they run: each model carries its own state from chunk to chunk.

Scored chunk by chunk with the state each sample file holds (the float model's), a quantized
recurrent model looks better than it runs: deployed, it feeds its own state back, and its error
compounds from one chunk to the next. Over data laid out as sequences (a folder per sequence, its
chunks in sorted order; see :mod:`qtool.calibration.dataset`), :func:`closed_loop_score` runs the
reference and the candidate each over every sequence, the first chunk with the state its file holds
and every later one with the state the same model returned for the chunk before (the state outputs
paired with their inputs by :mod:`qtool.evaluation.judged`). Each judged output's SQNR is pooled
over all chunks, with the lower confidence bound of the per-sequence spread.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from qtool.calibration.dataset import Dataset, sequences
from qtool.evaluation.confidence import CONFIDENCE, SampleEnergies
from qtool.evaluation.metrics import ErrorAccumulator
from qtool.graph.session import run_session
from qtool.schemas.reports.compare import ClosedLoop


def closed_loop_lines(score: ClosedLoop) -> list[str]:
    """The closed loop's figures as report lines."""
    fed = ", ".join(f"{out} -> {inp}" for out, inp in sorted(score.state.items()))
    lines = [
        f"closed loop over {score.sequences} sequences ({score.chunks} chunks), each model's state fed back: {fed}"
    ]
    for name, db in score.outputs.items():
        lines.append(f"{name}: {db:.2f} dB ({CONFIDENCE:.0%} bound {score.bounds[name]:.2f} dB on new sequences)")
    lines.append(f"worst sequence: {score.worst_sequence_db:.2f} dB")
    return lines


def closed_loop_score(
    sessions: tuple[ort.InferenceSession, ort.InferenceSession],
    dataset: Dataset,
    state: Mapping[str, str],
    judged: list[str],
) -> ClosedLoop | None:
    """Run both models closed-loop over each sequence of ``dataset`` (None: it holds no sequence of 2+ chunks).

    Only data laid out as sequences has any: a flat folder's samples are independent of each other.
    """
    inside = [i for i, path in enumerate(dataset.files) if path.parent != dataset.directory]  # sub-folders only
    groups = [[inside[i] for i in g] for g in sequences([dataset.files[i] for i in inside]) if len(g) > 1]
    if not groups or not state or not judged:
        return None
    reference, candidate = sessions
    names = [o.name for o in reference.get_outputs()]
    pooled = {name: ErrorAccumulator() for name in judged}
    signal: dict[str, list[float]] = {name: [] for name in judged}
    noise: dict[str, list[float]] = {name: [] for name in judged}
    per_sequence = []
    for group in groups:
        part = dataset.subset(group)
        carried: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] = ({}, {})
        sums = {name: ErrorAccumulator() for name in judged}
        for path, feed in part.samples():
            runs = []
            for session, own, label in ((reference, carried[0], "reference"), (candidate, carried[1], "candidate")):
                fed = {**feed, **{state[out]: value for out, value in own.items()}}
                values = dict(zip(names, run_session(session, None, fed, f"the {label} model on {path}"), strict=True))
                own.clear()
                own.update({out: np.asarray(values[out]) for out in state if out in values})
                runs.append(values)
            for name in judged:
                sums[name].add(np.asarray(runs[0][name]), np.asarray(runs[1][name]))
        for name, acc in sums.items():
            pooled[name].merge(acc)
            signal[name].append(acc.sum_ref_sq)
            noise[name].append(acc.sum_err_sq)
        per_sequence.append(min(acc.metrics(name).sqnr_db for name, acc in sums.items()))
    energies = {name: SampleEnergies(tuple(signal[name]), tuple(noise[name])) for name in judged}
    return ClosedLoop(
        sequences=len(groups),
        chunks=sum(len(g) for g in groups),
        state=dict(state),
        outputs={name: acc.metrics(name).sqnr_db for name, acc in pooled.items()},
        bounds={name: energies[name].lower_bound_db() for name in judged},
        worst_sequence_db=min(per_sequence),
    )
