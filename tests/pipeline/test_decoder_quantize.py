"""Decoders through quantize and tune: decode steps in the choice, the contrib form, MatMulNBits already there."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import qtool
from qtool.calibration.decoder import complete_feed, model_decoder
from qtool.cli import app
from qtool.options import EvaluationOptions, SearchOptions
from tests.conftest import SAMPLES, calib_dir, eval_dir, run_model, sample

runner = CliRunner()
GQA = SAMPLES / "decoder" / "model_gqa.onnx"
INT4 = "int4_matmul_nbits"


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def _ops(path: Path) -> Counter[str]:
    return Counter(node.op_type for node in onnx.load(path).graph.node)


@pytest.mark.slow
def test_the_default_never_keeps_a_placement_that_decodes_worse_than_dynamic_int8(tmp_path: Path) -> None:
    out, report = tmp_path / "d.onnx", tmp_path / "d.json"
    result = invoke("quantize", sample("decoder"), "--data", calib_dir("decoder"), "--eval", eval_dir("decoder"),
                    "-o", out, "--json", report)  # fmt: skip
    assert result.exit_code == 0, result.output
    choice = json.loads(report.read_text())["placement_choice"]
    bar = choice["decode_bar"]
    assert bar is not None and 0 < bar <= 1
    decodes = {c["name"]: c["decode_agreement"] for c in choice["candidates"]}
    assert all(value is not None for value in decodes.values()) and "dynamic" in str(choice["candidates"])
    assert decodes[choice["chosen"]] >= bar
    assert choice["decode_steps"] is True  # decode steps scored beside prefills
    eval_files = {p.name for p in eval_dir("decoder").iterdir()}
    held_out = choice["validations"][0]["samples"]
    assert set(choice["samples"]) <= eval_files and set(held_out) <= eval_files  # the data's own files
    assert len(set(choice["samples"])) == len(choice["samples"]) and not set(choice["samples"]) & set(held_out)
    assert "each as a prefill and as the decode step after it" in " ".join(result.output.split())
    assert "a placement below dynamic int8's" in result.output
    # the shape-arithmetic Gathers of the cache's length share one line
    assert sum("kept in float" in line and "Gather" in line for line in result.output.splitlines()) <= 2


@pytest.mark.slow
def test_the_contrib_form_quantizes_to_matmul_nbits_with_group_query_attention_intact(tmp_path: Path) -> None:
    out = tmp_path / "gqa.int4.onnx"
    result = qtool.quantize(GQA, out, config_path=INT4, data_dir=calib_dir("decoder"), evaluation=None)
    assert result.placements.get("weight_only", 0) >= 15
    before, after = _ops(GQA), _ops(out)
    assert after["MatMulNBits"] == before["MatMul"] and after["MatMul"] == 0
    assert after["GroupQueryAttention"] == before["GroupQueryAttention"] == 2
    originals = [n for n in onnx.load(GQA).graph.node if n.op_type == "GroupQueryAttention"]
    written = [n for n in onnx.load(out).graph.node if n.op_type == "GroupQueryAttention"]
    assert [list(n.attribute) for n in written] == [list(n.attribute) for n in originals]
    compared = qtool.compare(GQA, out, eval_dir("decoder"), options=EvaluationOptions(runs=0, limit=8))
    assert compared.language_model is not None
    assert compared.language_model.ppl_ratio < 1.01 and compared.language_model.next_token_agreement > 0.9


@pytest.mark.slow
def test_the_default_on_the_contrib_form_types_every_matmul(tmp_path: Path) -> None:
    """onnx's inference stops at every contrib op: without typing past them no MatMul could be quantized."""
    result = invoke("quantize", GQA, "--data", calib_dir("decoder"), "-o", tmp_path / "g.onnx", "--no-search")
    assert result.exit_code == 0, result.output
    assert "is unknown (shape inference could not tell)" not in result.output
    assert "passed through untouched" in result.output and "GroupQueryAttention x2" in result.output


def test_matmul_nbits_already_present_is_passed_through(tmp_path: Path) -> None:
    """As onnxruntime's model builder writes a decoder: int4 projections, a float embedding table."""
    given = tmp_path / "builder_int4.onnx"
    config = tmp_path / "int4_projections.yaml"
    config.write_text(
        "global: {weight: {dtype: int4, granularity: per_block, block_size: 32, format: matmul_nbits}, "
        "weight_only: true}\nop_type: {Gather: null}\n"
    )
    qtool.quantize(sample("decoder"), given, config_path=config, data_dir=calib_dir("decoder"), evaluation=None)
    model = onnx.load(given)
    model.producer_name = "onnxruntime-genai"  # qtool refuses its own outputs whatever they hold
    onnx.save(model, given)
    out = tmp_path / "again.onnx"
    result = invoke("quantize", given, "--data", calib_dir("decoder"), "-o", out, "--no-search")
    assert result.exit_code == 0, result.output
    assert "MatMulNBits x15" in result.output  # passed through untouched
    assert _ops(out)["MatMulNBits"] == _ops(given)["MatMulNBits"] == 15
    assert _ops(out)["DequantizeLinear"] > _ops(given)["DequantizeLinear"]  # the embedding table, quantized now
    compared = qtool.compare(sample("decoder"), out, eval_dir("decoder"), options=EvaluationOptions(runs=0, limit=4))
    assert compared.language_model is not None and compared.language_model.ppl_ratio < 1.05


@pytest.mark.slow
def test_tune_scores_decode_steps_beside_prefills(tmp_path: Path) -> None:
    report = tmp_path / "t.json"
    result = invoke("tune", sample("decoder"), "--data", calib_dir("decoder"), "--eval", eval_dir("decoder"),
                    "--target-sqnr", 25, "--time-budget", 60, "-o", tmp_path / "t.onnx",
                    "--config-out", tmp_path / "t.yaml", "--json", report)  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    samples = json.loads(report.read_text())["samples"]
    assert samples["decode_steps"] is True and "scored as a prefill and as the decode step after it" in result.stdout
    eval_files = sorted(p.name for p in eval_dir("decoder").iterdir())
    assert sorted(samples["selection"] + samples["validation"]) == eval_files  # EVAL's files, each named once


def _kv_config(tmp_path: Path, granularity: str) -> Path:
    config = tmp_path / "kv.yaml"
    config.write_text(f"kv_cache: {{dtype: int8, granularity: {granularity}}}\naccuracy: {{target_sqnr_db: null}}\n")
    return config


@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_an_int8_cache_is_calibrated_for_group_query_attention(tmp_path: Path, granularity: str) -> None:
    out = tmp_path / "kv.onnx"
    result = qtool.quantize(
        GQA, out, config_path=_kv_config(tmp_path, granularity), data_dir=calib_dir("decoder"), evaluation=None
    )
    assert any("key/value cache int8" in note for note in result.notes)
    model = onnx.load(out)
    cache = [v for v in [*model.graph.input, *model.graph.output] if "past" in v.name or "present" in v.name]
    assert len(cache) == 8 and {v.type.tensor_type.elem_type for v in cache} == {onnx.TensorProto.INT8}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["k_quant_type"] == attributes["v_quant_type"] == granularity.upper().encode()
        assert attributes["kv_cache_bit_width"] == 8
        scales = [inits[node.input[12]], inits[node.input[13]]]
        assert all(s.shape == ((2, 1, 32) if granularity == "per_channel" else (1,)) for s in scales)
        assert all(float(s.min()) > 0 for s in scales)
    # the float caches of the calibration prefills fit the scales: nothing clips
    float_model = onnx.load(GQA)
    decoder = model_decoder(float_model)
    assert decoder is not None
    names = [o.name for o in float_model.graph.output]
    for path in sorted(calib_dir("decoder").glob("*.npz"))[:4]:
        results = dict(zip(names, run_model(GQA, complete_feed(decoder, dict(np.load(path)))), strict=True))
        for node in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
            for present, scale in ((node.output[1], inits[node.input[12]]), (node.output[2], inits[node.input[13]])):
                largest = np.abs(results[present]).max(axis=(0, 2))[:, None, :]
                assert np.all(largest <= 127 * scale * (1 + 1e-5))
    compared = qtool.compare(GQA, out, eval_dir("decoder"), options=EvaluationOptions(runs=2, warmup=1, limit=8))
    lm = compared.language_model
    assert lm is not None and lm.ppl_ratio < 1.03 and lm.decode_agreement is not None and lm.decode_agreement > 0.85
    assert {m.name for m in compared.outputs} == {"logits"}  # the int8 caches are judged through the decode loop


def test_a_cache_setting_without_token_files_is_refused_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "kv.onnx"
    result = invoke("quantize", GQA, "--config", _kv_config(tmp_path, "per_channel"), "-o", out)
    assert result.exit_code == 2 and "kv_cache" in result.output and not out.exists()


def test_a_cache_setting_on_plain_ops_keeps_the_cache_float_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "kv.onnx"
    result = qtool.quantize(
        sample("decoder"), out, config_path=_kv_config(tmp_path, "per_channel"), data_dir=calib_dir("decoder"),
        evaluation=None,
    )  # fmt: skip
    assert any("the cache stays float" in note for note in result.notes)
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for i in onnx.load(out).graph.input[3:])


@pytest.mark.slow
def test_tune_to_a_decode_target_judges_free_running_agreement_on_token_files_it_never_chose_on(
    tmp_path: Path,
) -> None:
    report, out = tmp_path / "t.json", tmp_path / "t.onnx"
    result = invoke("tune", sample("decoder"), "--data", calib_dir("decoder"), "--eval", eval_dir("decoder"),
                    "--target-decode", 0.5, "--decode-steps", 8, "--time-budget", 90, "-o", out,
                    "--config-out", tmp_path / "t.yaml", "--json", report, "--no-cache")  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    doc = json.loads(report.read_text())
    assert doc["goal"] == "free-running agreement (8 steps) >= 0.5"
    validation = doc["validation"]
    # the figure is each validation token file's free-running agreement, averaged: recomputed here
    files = validation["samples"]  # EVAL's own token files, each named once
    selected = doc["samples"]["selection"]
    assert sorted(files + selected) == sorted(p.name for p in eval_dir("decoder").iterdir())
    held = tmp_path / "held"
    held.mkdir()
    for name in files:
        (held / name).write_bytes((eval_dir("decoder") / name).read_bytes())
    score = qtool.compare(sample("decoder"), out, held, options=EvaluationOptions(runs=0, decode_steps=8))
    assert score.language_model is not None
    assert validation["metric"] == pytest.approx(np.mean(score.language_model.free_running_by_sample), abs=1e-12)
    assert validation["metric"] == pytest.approx(score.language_model.free_running_agreement, abs=1e-12)
    assert validation["meets"] == (validation["metric_bound"] >= 0.5) == (result.exit_code == 0)
    assert selected and files and not set(selected) & set(files)


def test_a_judge_runs_only_the_decode_loop_it_is_asked_for(tmp_path: Path) -> None:
    # the placement choice reads the forced loop, tune's decode goal the free-running one: each alone
    # gives the figures both together give, and leaves the other unmeasured
    from qtool.calibration.dataset import Dataset
    from qtool.calibration.dataset_types import model_inputs
    from qtool.choice.decode import DecodeJudge
    from qtool.graph.session import create_session
    from qtool.graph.weights import Weights

    out = tmp_path / "int4.onnx"
    qtool.quantize(sample("decoder"), out, config_path=INT4, data_dir=calib_dir("decoder"), evaluation=None)
    model = onnx.load(sample("decoder"))
    decoder = model_decoder(model)
    assert decoder is not None
    data = Dataset(eval_dir("decoder"), model_inputs(model), limit=32)
    judge = DecodeJudge(model, Weights(), decoder, data, steps=16)
    session = create_session(out, "the int4 model")
    both, forced, free = judge.score(session), judge.score(session, free=False), judge.score(session, forced=False)
    assert forced.decode_agreement == both.decode_agreement and forced.free_running_agreement is None
    assert free.free_running_agreement == both.free_running_agreement and free.decode_agreement is None
    assert free.free_running_by_sample == both.free_running_by_sample and len(both.free_running_by_sample) == 32
    assert not forced.free_running_by_sample and forced.ppl_ratio == both.ppl_ratio
    assert both.free_running_agreement is not None and both.free_running_agreement < 1  # int4 differs somewhere


def test_the_cache_ranges_come_from_the_calibration_pass_and_from_a_pass_of_their_own_only_with_stats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qtool.pipeline.quantize as quantize

    passes: list[str] = []
    real = quantize.tapped_pass
    monkeypatch.setattr(quantize, "tapped_pass", lambda *args: passes.append(args[-1]) or real(*args))
    config = _kv_config(tmp_path, "per_channel")
    calibrated = qtool.quantize(GQA, tmp_path / "a.onnx", config_path=config, data_dir=calib_dir("decoder"))
    assert passes == []  # the calibration pass fed the ranges: no second pass over the token files
    stats = tmp_path / "s.json"
    qtool.write_stats(qtool.calibrate(GQA, calib_dir("decoder"), config_path=config), stats)
    search = SearchOptions(data_dir=calib_dir("decoder"))  # the token files the cache ranges read
    read = qtool.quantize(GQA, tmp_path / "b.onnx", config_path=config, stats_path=stats, search=search)
    # statistics from a file: the ranges need a pass of the samples, one with what the weight algorithms read
    assert passes == ["what the weight algorithms and the key/value cache read"]
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()  # the same samples' ranges
    notes = [n for n in calibrated.notes + read.notes if n.startswith("key/value cache int8")]
    assert len(notes) == 2 and notes[0] == notes[1]  # the same samples, the same scales note
