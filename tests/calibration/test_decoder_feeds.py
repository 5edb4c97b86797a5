"""Decoders: the interface found from names and shapes, token files completed, decode steps through the cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from qtool.calibration.dataset import Dataset, model_inputs
from qtool.calibration.decoder import complete_feed, find_decoder, model_decoder, next_step_feed
from qtool.errors import QtoolError
from sample_models import decoder as sample_decoder
from tests.conftest import SAMPLES, eval_dir, run_model, sample

GQA = SAMPLES / "decoder" / "model_gqa.onnx"


@pytest.mark.parametrize("path", [sample("decoder"), GQA], ids=["plain", "contrib"])
def test_both_forms_of_the_sample_decoder_are_recognised(path: Path) -> None:
    decoder = model_decoder(onnx.load(path, load_external_data=False))
    assert decoder is not None
    assert decoder.input_ids == "input_ids" and decoder.attention_mask == "attention_mask"
    assert decoder.position_ids == ("position_ids" if path != GQA else None)
    assert [c.past for c in decoder.cache] == [f"past_key_values.{i}.{k}" for i in (0, 1) for k in ("key", "value")]
    assert [c.present for c in decoder.cache] == [f"present.{i}.{k}" for i in (0, 1) for k in ("key", "value")]
    assert {(c.heads, c.head_dim) for c in decoder.cache} == {(2, 32)}
    assert decoder.logits == "logits"


@pytest.mark.parametrize("name", ["cnn", "encoder", "transformer"])
def test_models_without_a_cache_are_not_decoders(name: str) -> None:
    assert model_decoder(onnx.load(sample(name))) is None  # the encoder takes input_ids, but has no past


def test_a_token_file_becomes_a_prefill_that_runs_like_the_numpy_reference() -> None:
    model = onnx.load(sample("decoder"))
    decoder = model_decoder(model)
    assert decoder is not None
    ids = np.load(sorted(eval_dir("decoder").glob("*.npz"))[0])["input_ids"][:, :24]
    feed = complete_feed(decoder, {"input_ids": ids})
    assert feed["past_key_values.0.key"].shape == (1, 2, 0, 32)
    assert feed["attention_mask"].tolist() == [[1] * 24] and feed["position_ids"].tolist() == [list(range(24))]
    logits = run_model(sample("decoder"), feed)[0]
    weights = _weights(model)
    reference = sample_decoder.forward(np, weights, ids, sample_decoder.DecoderShape())
    np.testing.assert_allclose(logits, reference, atol=2e-4)


@pytest.mark.parametrize("path", [sample("decoder"), GQA], ids=["plain", "contrib"])
def test_decode_steps_through_the_cache_give_the_prefills_logits(path: Path) -> None:
    decoder = model_decoder(onnx.load(path, load_external_data=False))
    assert decoder is not None
    ids = np.load(sorted(eval_dir("decoder").glob("*.npz"))[1])["input_ids"][:, :20]
    whole = run_model(path, complete_feed(decoder, {"input_ids": ids}))[0]
    feed = complete_feed(decoder, {"input_ids": ids[:, :12]})
    names = [o.name for o in onnx.load(path, load_external_data=False).graph.output]
    for position in range(12, 20):
        results = dict(zip(names, run_model(path, feed), strict=True))
        feed = next_step_feed(decoder, feed, results, ids[:, position])
        assert feed["past_key_values.1.value"].shape[2] == position
    last = run_model(path, feed)[0]
    np.testing.assert_allclose(last[:, -1], whole[:, -1], atol=2e-4)


def test_npy_token_files_feed_a_multi_input_decoder(tmp_path: Path) -> None:
    for i in range(3):
        np.save(tmp_path / f"t{i}.npy", np.arange(10 + i, dtype=np.int64) + 40)
    dataset = Dataset(tmp_path, model_inputs(onnx.load(sample("decoder"))))
    feeds = [feed for _, feed in dataset.samples()]
    assert [f["input_ids"].shape for f in feeds] == [(1, 10), (1, 11), (1, 12)]
    assert all(f["past_key_values.1.key"].shape == (1, 2, 0, 32) for f in feeds)


def test_a_token_file_of_the_wrong_dtype_names_the_file(tmp_path: Path) -> None:
    np.savez(tmp_path / "t.npz", input_ids=np.arange(8, dtype=np.int32)[None])
    dataset = Dataset(tmp_path, model_inputs(onnx.load(sample("decoder"))))
    with pytest.raises(QtoolError, match=r"t\.npz: input 'input_ids' expects"):
        list(dataset.samples())


def test_an_empty_token_file_is_refused_naming_it(tmp_path: Path) -> None:
    np.savez(tmp_path / "empty.npz", input_ids=np.zeros((1, 0), np.int64))
    dataset = Dataset(tmp_path, model_inputs(onnx.load(sample("decoder"))))
    with pytest.raises(QtoolError, match=r"empty\.npz: 'input_ids' holds no token"):
        list(dataset.samples())


def test_cache_position_and_optimums_cache_branch_are_filled_and_advanced() -> None:
    from qtool.calibration.dataset_types import InputSpec

    inputs = [
        InputSpec("input_ids", np.dtype(np.int64), ("b", "s")),
        InputSpec("past_key_values.0.key", np.dtype(np.float16), ("b", 4, "p", 8)),
        InputSpec("past_key_values.0.value", np.dtype(np.float16), ("b", 4, "p", 8)),
        InputSpec("cache_position", np.dtype(np.int64), ("s",)),
        InputSpec("use_cache_branch", np.dtype(np.bool_), (1,)),
    ]
    decoder = find_decoder(inputs, ["logits", "present.0.key", "present.0.value"])
    assert decoder is not None and decoder.cache_position == "cache_position"
    assert decoder.filled == {"past_key_values.0.key", "past_key_values.0.value", "cache_position", "use_cache_branch"}
    feed = complete_feed(decoder, {"input_ids": np.arange(5, dtype=np.int64)})
    assert feed["cache_position"].tolist() == [0, 1, 2, 3, 4] and feed["use_cache_branch"].tolist() == [False]
    assert feed["past_key_values.0.key"].dtype == np.float16 and feed["past_key_values.0.key"].shape == (1, 4, 0, 8)
    grown = {name: np.zeros((1, 4, 5, 8), np.float16) for name in ("present.0.key", "present.0.value")}
    step = next_step_feed(decoder, feed, grown, np.array([7]))
    assert step["cache_position"].tolist() == [5] and step["use_cache_branch"].tolist() == [True]
    assert step["input_ids"].tolist() == [[7]] and step["past_key_values.0.value"].shape == (1, 4, 5, 8)


def test_a_cache_without_fixed_head_sizes_is_not_taken_for_one() -> None:
    from qtool.calibration.dataset_types import InputSpec

    inputs = [
        InputSpec("input_ids", np.dtype(np.int64), ("b", "s")),
        InputSpec("past_key_values.0.key", np.dtype(np.float32), ("b", "h", "p", "d")),
    ]
    assert find_decoder(inputs, ["logits", "present.0.key"]) is None


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The sample's weights under the names its numpy forward uses."""
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    shape = sample_decoder.DecoderShape()
    names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    parts = {
        "attn_norm": "input_layernorm",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    }
    for i in range(shape.layers):
        names |= {f"l{i}.{short}": f"model.layers.{i}.{long}.weight" for short, long in parts.items()}
    return {short: inits[long] for short, long in names.items()}
