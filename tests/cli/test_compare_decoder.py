"""compare on a decoder: perplexity, next-token agreement and the decode loop through the cache, as gates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.options import EvaluationOptions
from sample_models import decoder as sample_decoder
from tests.calibration.test_decoder_feeds import _weights
from tests.conftest import eval_dir, sample

runner = CliRunner()
QUICK = EvaluationOptions(runs=0, limit=6, decode_steps=8)


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def forgetful(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample decoder with its past multiplied by zero: prefills are exact, every decode step is wrong."""
    model = onnx.load(sample("decoder"))
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "forget.zero"))
    pasts = [i.name for i in graph.input if i.name.startswith("past_key_values")]
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name in pasts:
                node.input[position] = f"{name}.forgotten"
    forgets = [helper.make_node("Mul", [p, "forget.zero"], [f"{p}.forgotten"], name=f"forget/{p}") for p in pasts]
    nodes = forgets + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    path = tmp_path_factory.mktemp("forgetful") / "forgetful.onnx"
    onnx.save(model, path)
    return path


def test_the_reference_against_itself_agrees_everywhere() -> None:
    result = qtool.compare(sample("decoder"), sample("decoder"), eval_dir("decoder"), options=QUICK)
    lm = result.language_model
    assert lm is not None and lm.samples == 6 and lm.decode_steps == 8
    assert lm.ppl_ratio == 1.0 and lm.next_token_agreement == 1.0
    assert lm.decode_agreement == 1.0 and lm.free_running_agreement == 1.0 and lm.matched_prefix == 8
    assert result.output_kinds[0].kind == "next_token"


def test_perplexity_is_the_numpy_references() -> None:
    result = qtool.compare(sample("decoder"), sample("decoder"), eval_dir("decoder"), options=QUICK)
    weights, shape = _weights(onnx.load(sample("decoder"))), sample_decoder.DecoderShape()
    total, count = 0.0, 0
    for path in sorted(eval_dir("decoder").glob("*.npz"))[:6]:
        ids = np.load(path)["input_ids"]
        logits = sample_decoder.forward(np, weights, ids, shape).astype(np.float64)[0, :-1]
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        total += float((logz - logits[np.arange(len(logits)), ids[0, 1:]]).sum())
        count += len(logits)
    assert result.language_model is not None and result.language_model.tokens == count
    assert result.language_model.reference_perplexity == pytest.approx(math.exp(total / count), rel=1e-4)
    assert result.language_model.reference_perplexity < 8  # trained: far below the 256 of a uniform guess


def test_a_model_that_breaks_generation_passes_prefill_gates_and_fails_the_decode_gate(
    forgetful: Path, tmp_path: Path
) -> None:
    report = tmp_path / "r.json"
    markdown = tmp_path / "r.md"
    gates = ["--fail-over", "ppl_ratio=1.0001", "--fail-under", "next_token=0.999", "--fail-under", "sqnr=60"]
    passing = invoke("compare", sample("decoder"), forgetful, "--data", eval_dir("decoder"), "--runs", 0, *gates)
    assert passing.exit_code == 0, passing.output
    failing = invoke(
        "compare", sample("decoder"), forgetful, "--data", eval_dir("decoder"), "--runs", 0, "--limit", 8,
        "--fail-under", "decode_agreement=0.9", "--fail-under", "free_running=0.9",
        "--json", report, "--markdown", markdown,
    )  # fmt: skip
    assert failing.exit_code == 1, failing.output
    lm = json.loads(report.read_text())["accuracy"]["language_model"]
    assert lm["ppl_ratio"] == pytest.approx(1.0, abs=1e-5) and lm["next_token_agreement"] == 1.0
    assert lm["decode_agreement"] < 0.5 and lm["free_running_agreement"] < 0.5
    # the bound a new set of 8 prompts reaches 9 times in 10: below the mean, from the per-prompt spread
    assert 0 <= lm["free_running_bound"] <= lm["free_running_agreement"]
    assert "free-running" in markdown.read_text()
    assert "2 of 2 gates failed" in failing.output


def test_a_perplexity_gate_in_the_wrong_direction_says_which_one() -> None:
    result = invoke("compare", sample("decoder"), sample("decoder"), "--data", eval_dir("decoder"),
                    "--fail-under", "ppl_ratio=1.01")  # fmt: skip
    assert result.exit_code == 2
    assert "ppl_ratio is gated with --fail-over (lower is better)" in result.output


@pytest.mark.parametrize("steps", [-1, 100_000])
def test_decode_steps_out_of_range_are_refused(steps: int) -> None:
    result = invoke("compare", sample("decoder"), sample("decoder"), "--data", eval_dir("decoder"),
                    "--decode-steps", steps)  # fmt: skip
    assert result.exit_code == 2 and "--decode-steps must be an integer from 0 to 4096" in result.output


def test_single_token_files_have_no_perplexity_and_say_so(tmp_path: Path) -> None:
    # one token per file (a decode step's input): compared by the outputs' errors, with a warning; a
    # perplexity gate on them is not measured and fails
    np.savez(tmp_path / "one.npz", input_ids=np.array([[65]], np.int64))
    result = invoke("compare", sample("decoder"), sample("decoder"), "--data", tmp_path, "--runs", 0)
    assert result.exit_code == 0 and "every sample holds a single token" in result.output
    assert "perplexity" not in result.stdout and "logits" in result.stdout
    gated = invoke("compare", sample("decoder"), sample("decoder"), "--data", tmp_path, "--runs", 0,
                   "--fail-over", "ppl_ratio=1.01")  # fmt: skip
    assert gated.exit_code == 1 and "not measured" in gated.output


def test_a_decode_gate_without_the_decode_loop_is_refused() -> None:
    result = invoke("compare", sample("decoder"), sample("decoder"), "--data", eval_dir("decoder"),
                    "--decode-steps", 0, "--fail-under", "decode_agreement=0.9")  # fmt: skip
    assert result.exit_code == 2 and "--decode-steps 0" in result.output


def test_a_language_model_gate_on_a_classifier_is_not_measured_and_fails() -> None:
    result = invoke("compare", sample("cnn"), sample("cnn"), "--data", eval_dir("cnn"), "--runs", 0,
                    "--fail-over", "ppl_ratio=1.01")  # fmt: skip
    assert result.exit_code == 1 and "not measured" in result.output
