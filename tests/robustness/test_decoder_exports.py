"""Decoders as people export them (issue 45, class 1): logits found by role, filled inputs in the model's dtypes.

Each model is the sample decoder re-exported in the test: its logits cut to the last token ([batch, vocab]),
an int64 output listed before logits named ``scores``, an int32 attention mask and positions. Each is compared
and quantized with data like the sample; token files of the wrong rank and ids past the vocabulary are one
clear line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

import qtool
from qtool.calibration.dataset_types import InputSpec
from qtool.calibration.decoder import find_decoder, model_decoder
from qtool.cli import app
from qtool.options import EvaluationOptions
from tests.conftest import calib_dir, eval_dir, sample

runner = CliRunner()
QUICK = EvaluationOptions(runs=0, limit=6, decode_steps=6)


def _rename(model: onnx.ModelProto, old: str, new: str) -> None:
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]


def _last_token(model: onnx.ModelProto) -> onnx.ModelProto:
    """Logits of the last position only, as exports that keep one logit row write them."""
    _rename(model, "logits", "every_position")
    model.graph.initializer.append(helper.make_tensor("last", TensorProto.INT64, [], [-1]))
    model.graph.node.append(helper.make_node("Gather", ["every_position", "last"], ["logits"], axis=1, name="last"))
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.CopyFrom(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 256]))
    return model


def _aux_first(model: onnx.ModelProto) -> onnx.ModelProto:
    """An int64 output listed first, and the logits named ``scores``."""
    _rename(model, "logits", "scores")
    model.graph.node.append(helper.make_node("ArgMax", ["scores"], ["next_token"], axis=-1, keepdims=0))
    outputs = list(model.graph.output)
    for output in outputs:
        if output.name == "logits":
            output.name = "scores"
    del model.graph.output[:]
    model.graph.output.extend([helper.make_tensor_value_info("next_token", TensorProto.INT64, ["b", "s"]), *outputs])
    return model


def _int32_mask(model: onnx.ModelProto) -> onnx.ModelProto:
    """int32 attention mask and position ids (cast to int64 inside)."""
    for name in ("attention_mask", "position_ids"):
        next(i for i in model.graph.input if i.name == name).type.tensor_type.elem_type = TensorProto.INT32
        _rename(model, name, f"{name}/int64")
        model.graph.node.insert(0, helper.make_node("Cast", [name], [f"{name}/int64"], to=TensorProto.INT64))
    return model


EXPORTS = {"last_token": _last_token, "aux_first": _aux_first, "int32_mask": _int32_mask}


@pytest.fixture(scope="module", params=sorted(EXPORTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    model = EXPORTS[request.param](onnx.load(sample("decoder")))
    onnx.checker.check_model(model)
    path = tmp_path_factory.mktemp(request.param) / "model.onnx"
    onnx.save(model, path)
    return request.param, path


def test_the_interface_finds_the_logits_by_role_and_the_dtypes_it_fills(exported: tuple[str, Path]) -> None:
    kind, path = exported
    decoder = model_decoder(onnx.load(path))
    assert decoder is not None
    assert decoder.logits == ("scores" if kind == "aux_first" else "logits")
    fills = np.int32 if kind == "int32_mask" else np.int64
    assert decoder.integers("attention_mask") == fills and decoder.integers("position_ids") == fills


def test_compare_scores_every_export_as_the_standard_one(exported: tuple[str, Path]) -> None:
    """Perplexity over every position, also where only the last token's logits come out (fed through the cache)."""
    _, path = exported
    standard = qtool.compare(sample("decoder"), sample("decoder"), eval_dir("decoder"), options=QUICK)
    result = qtool.compare(path, path, eval_dir("decoder"), options=QUICK)
    lm, ref = result.language_model, standard.language_model
    assert lm is not None and ref is not None
    assert lm.tokens == ref.tokens
    assert lm.reference_perplexity == pytest.approx(ref.reference_perplexity, rel=1e-4)
    assert lm.next_token_agreement == 1.0 and lm.free_running_agreement == 1.0


@pytest.mark.slow
def test_quantize_with_data_writes_a_model_that_runs(exported: tuple[str, Path], tmp_path: Path) -> None:
    _, path = exported
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    r = runner.invoke(
        app, ["quantize", str(path), "--data", str(calib_dir("decoder")), "-o", str(out), "--json", str(report)]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["compression_ratio"] > 3
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feed_names = {i.name for i in session.get_inputs()}
    assert {"input_ids", "attention_mask"} <= feed_names


def test_find_decoder_takes_the_widest_float_output_when_none_is_named_logits() -> None:
    inputs = [
        InputSpec("input_ids", np.dtype(np.int64), ("b", "s")),
        InputSpec("past_key_values.0.key", np.dtype(np.float32), ("b", 2, "p", 16)),
    ]
    outputs = [
        InputSpec("token", np.dtype(np.int64), ("b",)),
        InputSpec("hidden", np.dtype(np.float32), ("b", "s", 64)),
        InputSpec("vocab_scores", np.dtype(np.float32), ("b", "s", 1000)),
        InputSpec("present.0.key", np.dtype(np.float32), ("b", 2, "t", 16)),
    ]
    decoder = find_decoder(inputs, outputs)
    assert decoder is not None and decoder.logits == "vocab_scores"
    assert find_decoder(inputs, outputs[:1] + outputs[3:]) is not None
    assert find_decoder(inputs, outputs[:1] + outputs[3:]).logits is None  # type: ignore[union-attr]


def _one_error(args: list[str]) -> str:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert lines[0].startswith("error:"), r.output  # nothing of onnxruntime's own log before it
    return lines[0]


def test_a_rank_3_token_file_is_one_line_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "tokens"
    data.mkdir()
    np.savez(data / "cube.npz", input_ids=np.ones((1, 1, 5), np.int64))
    line = _one_error(["calibrate", str(sample("decoder")), str(data), "-o", str(tmp_path / "s.json")])
    assert "cube.npz" in line and "[1, 1, 5]" in line
    assert not (tmp_path / "s.json").exists()


def test_token_ids_past_the_vocabulary_are_qtools_error_first(tmp_path: Path) -> None:
    data = tmp_path / "tokens"
    data.mkdir()
    np.savez(data / "oov.npz", input_ids=np.array([[1, 2, 5000]], np.int64))
    line = _one_error(["compare", str(sample("decoder")), str(sample("decoder")), "--data", str(data), "--runs", "0"])
    assert "oov.npz" in line
