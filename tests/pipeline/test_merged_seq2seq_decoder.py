"""A seq2seq decoder as Hugging Face optimum exports it: merged (an If on use_cache_branch), encoder states as inputs.

The fixture is a 1-layer T5 decoder with random weights (d_model 32, vocab 256) exported by optimum-onnx 0.1.0
(``optimum-cli export onnx --task text2text-generation-with-past``, opset 18): the graph is optimum's, the
weights do not matter. Its samples are made here from the model itself: a first pass (no cache) and the
decode step after it, fed the cache the first pass returned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import ROOT

MERGED = ROOT / "tests" / "fixtures" / "seq2seq" / "t5_decoder_merged.onnx"
runner = CliRunner()


def _samples(folder: Path, count: int, seed: int, *, steps_only: bool = False) -> Path:
    """``count`` samples: first passes (no cache) and decode steps fed the cache a first pass returned."""
    session = ort.InferenceSession(str(MERGED), providers=["CPUExecutionProvider"])
    inputs, outputs = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for index in range(count):
        encoder = int(rng.integers(4, 12))
        first = {
            "input_ids": rng.integers(3, 256, size=(1, int(rng.integers(2, 6)))).astype(np.int64),
            "encoder_hidden_states": rng.standard_normal((1, encoder, 32)).astype(np.float32),
            "encoder_attention_mask": np.ones((1, encoder), np.int64),
            "use_cache_branch": np.array([False]),
        }
        for name in inputs:  # the first pass ignores the cache: a placeholder of one position
            if name.startswith("past_key_values"):
                first[name] = np.zeros((1, 4, 1 if ".decoder." in name else encoder, 8), np.float32)
        feed = first
        if steps_only or index % 2:
            returned = dict(zip(outputs, session.run(None, first), strict=True))
            feed = {**first, "input_ids": rng.integers(3, 256, size=(1, 1)).astype(np.int64)}
            feed["use_cache_branch"] = np.array([True])
            for name in inputs:
                if name.startswith("past_key_values"):
                    feed[name] = returned[name.replace("past_key_values", "present")]
        np.savez(folder / f"s{index:03d}.npz", **feed)
    return folder


def _float_values(model: onnx.ModelProto) -> dict[str, int]:
    """Values of each float32 initializer, in the graph and in its If branches."""
    graphs = [model.graph, *(a.g for node in model.graph.node for a in node.attribute if a.type == a.GRAPH)]
    floats = (i for g in graphs for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT)
    return {i.name: int(np.prod(i.dims)) for i in floats}


def test_a_merged_seq2seq_decoder_quantizes_with_its_shared_embedding_stored_8_bit(tmp_path):
    calib, evaluation = _samples(tmp_path / "calib", 12, 1), _samples(tmp_path / "eval", 6, 2)
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(MERGED), "--data", str(calib), "--eval", str(evaluation), "-o", str(out)])
    # before: onnx's data propagation fixed a branch output to the export's example size (onnxruntime then
    # refused the first sample); the decode steps qtool makes dropped the encoder states and took the cached
    # branch's empty encoder cache as the next past
    assert r.exit_code == 0, r.stderr
    floats, before = _float_values(onnx.load(out)), _float_values(onnx.load(MERGED))
    assert max(floats.values()) < 4096, sorted(floats.items(), key=lambda kv: -kv[1])[:3]  # the 256x32 embedding too
    assert sum(floats.values()) < 0.1 * sum(before.values())  # the weights both branches share are stored 8-bit
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(str(MERGED), providers=["CPUExecutionProvider"])
    for path in sorted(evaluation.glob("*.npz")):  # both branches, against the float model
        feed = dict(np.load(path))
        ours, theirs = session.run(["logits"], feed)[0], reference.run(["logits"], feed)[0]
        noise = float(np.sum((ours - theirs) ** 2))
        assert 10 * np.log10(float(np.sum(theirs**2)) / noise) > 30, path.name


def test_decode_step_samples_alone_are_compared_by_their_errors(tmp_path):
    calib = _samples(tmp_path / "calib", 8, 3, steps_only=True)
    steps = _samples(tmp_path / "steps", 4, 5, steps_only=True)
    out = tmp_path / "q.onnx"
    r = runner.invoke(app, ["quantize", str(MERGED), "--data", str(calib), "--eval", str(steps), "-o", str(out)])
    # before: "every sample holds a single token: perplexity needs a next token to score", exit 2
    assert r.exit_code == 0, r.stderr
    assert "every sample holds a single token (a decode step with its past)" in r.stderr
    assert "logits" in r.stdout and out.exists()


@pytest.mark.parametrize("branch", ["then_branch", "else_branch"])
def test_prepare_keeps_each_branch_output_as_exported(branch):
    from qtool.graph.prepare import prepare_model

    model = onnx.load(MERGED)
    prepared, _ = prepare_model(model)
    (before,) = [a.g for a in model.graph.node[0].attribute if a.name == branch]
    (after,) = [a.g for a in prepared.graph.node[0].attribute if a.name == branch]
    assert [o.SerializeToString() for o in after.output] == [o.SerializeToString() for o in before.output]
