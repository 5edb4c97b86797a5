"""Streaming models over sequences (issue 46): data laid out a folder per sequence, each model fed its own state.

The model is built here: a chunk and a recurrent state in, a probability and the next state out. compare
runs both models closed-loop over each sequence; its figures are checked against the same loop written out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from qtool.cli import app
from tests.evaluation.test_judged_outputs import _streaming

runner = CliRunner()


@pytest.fixture(scope="module")
def streaming(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The float model, a candidate whose state weights are a little off, and 3 sequences of 6 chunks."""
    folder = tmp_path_factory.mktemp("streaming")
    model = _streaming()
    reference = folder / "model.onnx"
    onnx.save(model, reference)
    for init in model.graph.initializer:
        if init.name == "w_state":
            values = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((values * 1.05).astype(np.float32), "w_state"))
    candidate = folder / "drifting.onnx"
    onnx.save(model, candidate)
    data = folder / "sequences"
    rng = np.random.default_rng(11)
    for s in range(3):
        (data / f"seq{s}").mkdir(parents=True)
        for c in range(6):
            chunk = rng.standard_normal((1, 64)).astype(np.float32)
            np.savez(data / f"seq{s}" / f"{c:02d}.npz", chunk=chunk, state=np.zeros((1, 32), np.float32))
    return reference, candidate, data


def _closed_loop_sqnr(reference: Path, candidate: Path, data: Path) -> float:
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate)]
    signal = noise = 0.0
    for folder in sorted(data.iterdir()):
        states = [None, None]
        for path in sorted(folder.glob("*.npz")):
            feed = dict(np.load(path))
            probs = []
            for i, session in enumerate(sessions):
                fed = {**feed, "state": states[i]} if states[i] is not None else feed
                prob, state = session.run(["prob", "stateN"], fed)
                states[i] = state
                probs.append(prob.astype(np.float64))
            signal += float(np.sum(probs[0] ** 2))
            noise += float(np.sum((probs[0] - probs[1]) ** 2))
    return 10 * np.log10(signal / noise)


def test_compare_runs_each_model_closed_loop_over_the_sequences(
    streaming: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    reference, candidate, data = streaming
    report = tmp_path / "r.json"
    r = runner.invoke(app, ["compare", str(reference), str(candidate), "--data", str(data), "--runs", "0"])
    assert r.exit_code == 0, r.output
    assert "closed loop over 3 sequences (18 chunks)" in r.output and "stateN -> state" in r.output
    r = runner.invoke(
        app, ["compare", str(reference), str(candidate), "--data", str(data), "--runs", "0", "--json", str(report)]
    )
    loop = json.loads(report.read_text())["accuracy"]["closed_loop"]
    assert loop["sequences"] == 3 and loop["chunks"] == 18 and loop["state"] == {"stateN": "state"}
    assert loop["outputs"]["prob"] == pytest.approx(_closed_loop_sqnr(reference, candidate, data), abs=0.01)
    assert loop["bounds"]["prob"] <= loop["outputs"]["prob"]


def test_a_sequence_layout_calibrates_and_quantizes(streaming: tuple[Path, Path, Path], tmp_path: Path) -> None:
    reference, _, data = streaming
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(reference), "--data", str(data), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "closed loop over 3 sequences" in r.output  # quantize's comparison runs it too


def test_a_flat_folder_of_samples_is_not_run_as_a_sequence(streaming: tuple[Path, Path, Path], tmp_path: Path) -> None:
    reference, candidate, data = streaming
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(data.glob("*/*.npz")):
        (flat / f"{path.parent.name}-{path.name}").write_bytes(path.read_bytes())
    r = runner.invoke(app, ["compare", str(reference), str(candidate), "--data", str(flat), "--runs", "0"])
    assert r.exit_code == 0, r.output
    assert "closed loop" not in r.output


def test_the_placement_choice_validates_closed_loop_on_whole_sequences(
    streaming: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    reference, _, data = streaming
    r = runner.invoke(app, ["quantize", str(reference), "--data", str(data), "-o", str(tmp_path / "q.onnx")])
    assert r.exit_code == 0, r.output
    assert "also closed-loop over their sequences" in r.output
    validated = next(line for line in r.output.splitlines() if line.startswith("validated:"))
    assert "on 6 samples" in validated  # one whole sequence of the three: sequences are split whole


def test_sequences_split_whole_and_spread_by_sequence(streaming: tuple[Path, Path, Path]) -> None:
    from qtool.calibration.dataset import Dataset
    from qtool.calibration.dataset_types import model_inputs
    from qtool.evaluation.split import split_samples

    reference, _, data = streaming
    inputs = model_inputs(onnx.load(str(reference)))
    split = split_samples(Dataset(data, inputs))
    chosen = {p.parent.name for p in split.selection.files}
    assert chosen.isdisjoint({p.parent.name for p in split.validation.files})
    assert len(split.selection.files) + len(split.validation.files) == 18
    spread = Dataset(data, inputs, spread=7)  # 7 chunks' worth: 2 whole sequences of 6
    assert len(spread.files) == 12 and len({p.parent for p in spread.files}) == 2


def test_compare_gates_judge_the_outputs_that_matter(streaming: tuple[Path, Path, Path], tmp_path: Path) -> None:
    reference, _, data = streaming
    model = onnx.load(reference)
    for init in model.graph.initializer:  # an error in the probability alone: the state is exact
        if init.name == "w_out":
            init.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(init) * 1.03).astype(np.float32), "w_out"))
    candidate = tmp_path / "off.onnx"
    onnx.save(model, candidate)
    report = tmp_path / "r.json"
    base = ["compare", str(reference), str(candidate), "--data", str(data), "--runs", "0", "--json", str(report)]
    r = runner.invoke(app, base)
    accuracy = json.loads(report.read_text())["accuracy"]
    sqnr = {m["name"]: m["sqnr_db"] for m in [*accuracy["outputs"], accuracy["overall"]]}
    assert sqnr["stateN"] is None and sqnr["prob"] < sqnr["overall"]  # the exact state lifts the pooled figure
    assert accuracy["judged"]["sqnr_db"] == pytest.approx(sqnr["prob"]) and "stateN (fed back as state)" in r.output
    between = f"sqnr={(sqnr['prob'] + sqnr['overall']) / 2:.2f}"
    r = runner.invoke(app, [*base, "--fail-under", between])
    assert r.exit_code == 1, r.output  # the probability decides, not the state fed back
    r = runner.invoke(app, [*base, "--fail-under", between, "--outputs", "stateN"])
    assert r.exit_code == 0, r.output
    note = json.loads(report.read_text())["accuracy"]["judged_note"]
    assert note == "the target judges the outputs named: stateN; state fed back: stateN -> state"
    r = runner.invoke(app, [*base, "--outputs", "nope"])
    assert r.exit_code == 2 and "'nope' names no output" in r.output and "prob, stateN" in r.output


def test_candidates_are_scored_closed_loop_each_on_its_own_state(streaming: tuple[Path, Path, Path]) -> None:
    from qtool.calibration.dataset import Dataset
    from qtool.calibration.dataset_types import model_inputs
    from qtool.evaluation.scoring import OutputScorer

    reference, candidate, data = streaming
    model = onnx.load(str(reference))
    dataset = Dataset(data, model_inputs(model))
    closed = OutputScorer(model, dataset, judged=frozenset({"prob"}), state={"stateN": "state"})
    score = closed.score(onnx.load(str(candidate)))
    # the drifting state weights show only when each model feeds its own state back, as the loop written out
    assert score.worst_db == pytest.approx(_closed_loop_sqnr(reference, candidate, data), abs=0.01)
    assert score.outputs["stateN"] < 100 and len(score.energies["prob"].signal) == 18
    assert OutputScorer(model, dataset).score(onnx.load(str(candidate))).worst_db == np.inf  # fed the file's state
    # per sequence, the same energies compare's closed loop sums: the same bound over new sequences
    from qtool.evaluation.closed_loop import closed_loop_score

    sessions = tuple(ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate))
    loop = closed_loop_score(sessions, dataset, {"stateN": "state"}, ["prob"])  # type: ignore[arg-type]
    per_sequence = closed.per_sequence(score)
    assert loop is not None and per_sequence is not None and set(per_sequence) == {"prob"}
    assert len(per_sequence["prob"].signal) == 3
    assert per_sequence["prob"].lower_bound_db() == pytest.approx(loop.bounds["prob"], abs=1e-6)
    assert OutputScorer(model, dataset).per_sequence(score) is None  # no state: no sequence ran closed-loop
    # a subset that skips a chunk starts that chunk again from the state its file holds
    skipping = Dataset(data, model_inputs(model)).subset([0, 2, 3])
    partial = OutputScorer(model, skipping, judged=frozenset({"prob"}), state={"stateN": "state"})
    assert partial._follows == [False, False, True]


def test_calibration_follows_the_float_model_through_each_sequence(
    streaming: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    reference, _, data = streaming
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(data.glob("*/*.npz")):  # the same chunks, each on its own: the state its file holds (zeros)
        (flat / f"{path.parent.name}_{path.name}").write_bytes(path.read_bytes())
    ranges = {}
    for name, folder in (("sequences", data), ("flat", flat)):
        out = tmp_path / f"{name}.json"
        r = runner.invoke(app, ["calibrate", str(reference), str(folder), "-o", str(out), "--observer", "minmax"])
        assert r.exit_code == 0, r.output
        ranges[name] = json.loads(out.read_text())["tensors"]["state"]["state"]
    # over sequences the state input holds what the float model fed back (a Tanh: up to +-1), not only zeros
    assert ranges["flat"] == {"min": 0.0, "max": 0.0}
    assert ranges["sequences"]["max"] > 0.5 and ranges["sequences"]["min"] < -0.5


def test_shards_of_sequences_hold_whole_sequences_and_merge_to_one_process(
    streaming: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    reference, _, data = streaming
    whole, parts = tmp_path / "whole.json", [tmp_path / "1.json", tmp_path / "2.json"]
    args = ["calibrate", str(reference), str(data), "--observer", "minmax"]
    assert runner.invoke(app, [*args, "-o", str(whole)]).exit_code == 0
    for k, part in enumerate(parts, 1):
        r = runner.invoke(app, [*args, "-o", str(part), "--shard", f"{k}/2"])
        assert r.exit_code == 0, r.output
    samples = [json.loads(p.read_text())["samples"] for p in parts]
    assert samples == [12, 6]  # sequences 1 and 3 whole, then sequence 2: each carries its state from chunk to chunk
    merged = tmp_path / "merged.json"
    assert runner.invoke(app, ["merge", *map(str, parts), "-o", str(merged)]).exit_code == 0
    assert json.loads(merged.read_text())["tensors"] == json.loads(whole.read_text())["tensors"]
