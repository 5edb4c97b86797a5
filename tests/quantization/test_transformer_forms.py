"""Transformer weight forms end to end: dynamic quantization, embedding tables, Einsum projections."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.errors import QtoolError
from tests.conftest import calib_dir, eval_dir, run_model, sample

DYNAMIC = "global: {mode: dynamic, placement: integer}\n"


def _sqnr(reference: Path, candidate: Path, feeds: list[dict[str, np.ndarray]]) -> float:
    num = den = 0.0
    for feed in feeds:
        r, c = run_model(reference, feed)[0], run_model(candidate, feed)[0]
        num, den = num + float((r**2).sum()), den + float(((r - c) ** 2).sum())
    return 10 * np.log10(num / den)


def _optimized_ops(path: Path, tmp_path: Path) -> list[str]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def _quantize(tmp_path: Path, model: Path, data: Path, config: str, tag: str) -> tuple[Path, qtool.QuantizeResult]:
    path = tmp_path / f"{tag}.yaml"
    path.write_text(config)
    out = tmp_path / f"{tag}.quantized.onnx"
    result = qtool.quantize(model, out, config_path=path, data_dir=data, search=None, evaluation=None)
    return out, result


def test_dynamic_mode_runs_every_weighted_matmul_as_onnxruntimes_fused_dynamic_kernel(tmp_path):
    out, result = _quantize(tmp_path, sample("transformer"), calib_dir("transformer"), DYNAMIC, "dynamic")
    weighted = [f"attn/{p}/matmul" for p in ("q", "k", "v", "out")] + ["ffn/up/matmul", "ffn/down/matmul"]
    assert set(weighted) <= set(result.rewrite.quantized_nodes)
    # The attention scores and context multiply two activations: both are quantized at run time too.
    assert result.placements == {"dynamic": len(weighted) + 2}
    assert result.rewrite.quantized_activations == []  # nothing needed a calibrated range
    # Q, K and V read one input, quantized once: MatMulIntegerToFloat; the others fuse their own quantization.
    assert result.kernels == {"DynamicQuantizeMatMul": 5, "MatMulIntegerToFloat": 3}
    ops = _optimized_ops(out, tmp_path)
    assert ops.count("DynamicQuantizeMatMul") == 5 and ops.count("MatMulIntegerToFloat") == 3
    assert "MatMulInteger" not in ops and "MatMul" not in ops
    feeds = [{"input": np.load(p)[None]} for p in sorted(eval_dir("transformer").glob("*.npy"))[:16]]
    assert _sqnr(sample("transformer"), out, feeds) > 30


def test_dynamic_gemm_with_transposed_weight_and_bias_matches_float(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.1, (32, 64)).astype(np.float32)  # [N, K], read with transB
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.normal(0, 0.1, 32).astype(np.float32), "b")],
    )
    model = tmp_path / "gemm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.normal(size=(2, 64)).astype(np.float32))
    out, result = _quantize(tmp_path, model, data, DYNAMIC, "gemm")
    assert result.placements == {"dynamic": 1}
    assert _optimized_ops(out, tmp_path) == ["DynamicQuantizeMatMul"]
    feeds = [{"x": rng.normal(size=(8, 64)).astype(np.float32)} for _ in range(4)]
    assert _sqnr(model, out, feeds) > 35


def test_an_embedding_table_is_stored_per_row_and_counted_in_the_size(tmp_path):
    rng = np.random.default_rng(1)
    table = rng.normal(0, 0.05, (4000, 32)).astype(np.float32)
    table[:, 3] *= 8  # an outlier dimension, as BERT's embeddings have
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
            helper.make_node("ReduceMean", ["e"], ["y"], name="pool", axes=[1], keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
        [numpy_helper.from_array(table, "emb")],
    )
    model = tmp_path / "emb.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.integers(0, 4000, (1, 16)))
    feeds = [{"ids": rng.integers(0, 4000, (2, 16))} for _ in range(8)]
    sizes = {}
    for dtype, floor in (("int8", 35.0), ("int4", 12.0)):
        out, result = _quantize(tmp_path, model, data, f"op_type: {{Gather: {{weight: {{dtype: {dtype}}}}}}}\n", dtype)
        assert result.rewrite.quantized_nodes == ["embed"] and result.placements == {"lookup": 1}
        assert result.kernels == {"Gather": 1}
        written = onnx.load(out)
        stored = next(i for i in written.graph.initializer if i.name.startswith("emb/quantized"))
        assert list(stored.dims) == [4000, 32]
        scales = next(i for i in written.graph.initializer if i.name.startswith("embed/scale"))
        assert list(scales.dims) == [4000, 1]  # one scale per row, gathered with the rows
        # The table stays integer in memory: the Gather reads the stored integers, the rows are dequantized after it.
        lookup = next(n for n in written.graph.node if n.name == "embed")
        assert lookup.op_type == "Gather" and lookup.input[0].startswith("emb/")
        assert "DequantizeLinear" not in {n.op_type for n in written.graph.node}
        assert _optimized_ops(out, tmp_path).count("Gather") == 2  # rows and scales: nothing folded to float
        assert _sqnr(model, out, feeds) > floor
        sizes[dtype] = out.stat().st_size
    original = model.stat().st_size
    assert original / sizes["int8"] > 3.5 and original / sizes["int4"] > 6.0


def test_an_einsum_projection_is_quantized_like_a_matmul(tmp_path):
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.2, (16, 4, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Einsum", ["x", "w"], ["y"], name="qkv", equation="bsd,dhk->bshk")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8, 4, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    model = tmp_path / "einsum.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i}.npy", rng.normal(size=(1, 8, 16)).astype(np.float32))
    out, result = _quantize(tmp_path, model, data, "global: {placement: integer}\n", "einsum")
    assert result.prepare.einsums_as_matmuls == ["qkv"]
    # its output only feeds the model's: a float output, MatMulIntegerToFloat as onnxruntime runs it
    assert result.rewrite.quantized_nodes == ["qkv"] and result.kernels == {"MatMulIntegerToFloat": 1}
    scale = next(i for i in onnx.load(out).graph.initializer if i.name == "qkv/weight/scale")
    assert np.asarray(numpy_helper.to_array(scale)).size == 32  # per output column: 4 heads x 8
    feeds = [{"x": rng.normal(size=(2, 8, 16)).astype(np.float32)} for _ in range(4)]
    assert _sqnr(model, out, feeds) > 30


def test_configs_that_need_no_statistics_quantize_without_data(tmp_path):
    model = sample("transformer")
    config = tmp_path / "dynamic.yaml"
    out = tmp_path / "dynamic.onnx"
    config.write_text(DYNAMIC)
    result = qtool.quantize(model, out, config_path=config, search=None, evaluation=None)
    assert result.placements == {"dynamic": 8} and result.calibration_samples == 0
    feeds = [{"input": np.load(p)[None]} for p in sorted(eval_dir("transformer").glob("*.npy"))[:8]]
    assert _sqnr(model, out, feeds) > 30

    static = tmp_path / "static.yaml"
    static.write_text("global: {placement: integer}\n")
    with pytest.raises(QtoolError, match=r"\d+ activations are quantized statically: give --data"):
        qtool.quantize(model, tmp_path / "static.onnx", config_path=static, search=None, evaluation=None)
    assert not (tmp_path / "static.onnx").exists()


def test_the_placement_choice_measures_a_dynamic_candidate_only_for_matmul_heavy_models(tmp_path):
    def candidates(name: str) -> set[str]:
        out = tmp_path / f"{name}.onnx"
        result = qtool.quantize(sample(name), out, data_dir=calib_dir(name), evaluation=None)
        choice = result.placement_choice
        assert choice is not None
        return {c.name for c in choice.candidates} | {a for c in choice.candidates for a in c.same_as}

    assert "dynamic" in candidates("transformer")  # every weighted node is a MatMul
    assert "dynamic" not in candidates("cnn")  # the convolutions do the work: no dynamic kernels for them


def test_weight_only_int4_keeps_the_final_projections_int8_unless_told_otherwise(tmp_path):
    int4 = "global: {weight_only: true, weight: {dtype: int4, granularity: per_block, block_size: 16%s}}\n"

    def dtypes(config: str, tag: str) -> dict[str, str]:
        path = tmp_path / f"{tag}.yaml"
        path.write_text(config)
        rows = qtool.inspect(sample("transformer"), config_path=path).rows
        return {r.name: r.weight.split()[0] for r in rows if r.weight != "-"}

    # The output adds the attention output (through the residual) and the FFN's: both are final.
    kept = dtypes(int4 % "", "default")
    assert kept.pop("attn/out/matmul") == "int8" and kept.pop("ffn/down/matmul") == "int8"
    assert set(kept.values()) == {"int4"}
    assert set(dtypes(int4 % ", final_layer_int8: false", "off").values()) == {"int4"}
    explicit = int4 % "" + "node_name: {ffn/down/matmul: {weight: {dtype: int4}}}\n"
    assert dtypes(explicit, "explicit")["ffn/down/matmul"] == "int4"


NBITS = "global: {weight_only: true, weight: {dtype: %s, granularity: per_block, block_size: 16, format: %s}%s}\n"


def test_matmul_nbits_is_written_directly_and_computes_what_the_qdq_form_does(tmp_path):
    feeds = [{"input": np.load(p)[None]} for p in sorted(eval_dir("transformer").glob("*.npy"))[:8]]
    reference = np.concatenate([run_model(sample("transformer"), f)[0].ravel() for f in feeds])
    for dtype, extra in (("int4", ""), ("uint4", ", symmetric: false")):
        outputs = {}
        # onnxruntime fuses the QDQ form into MatMulNBits at accuracy_level 4 (int8 activations inside).
        for form, level in (("qdq", 0), ("matmul_nbits", 4), ("matmul_nbits", 0)):
            path = tmp_path / f"{dtype}.{form}.{level}.yaml"
            path.write_text((NBITS % (dtype, form, "")).replace("format", f"accuracy_level: {level}{extra}, format"))
            out = tmp_path / f"{dtype}.{form}.{level}.onnx"
            result = qtool.quantize(sample("transformer"), out, config_path=path, search=None, evaluation=None)
            outputs[(form, level)] = np.concatenate([run_model(out, f)[0].ravel() for f in feeds])
            if form == "matmul_nbits":
                written = onnx.load(out)
                assert [n.op_type for n in written.graph.node].count("MatMulNBits") == 6
                assert "DequantizeLinear" not in {n.op_type for n in written.graph.node}
                assert any(o.domain == "com.microsoft" for o in written.opset_import)
                assert result.kernels == {"MatMulNBits": 6}
        # The same codes and scales: at the same accuracy level the two forms agree to float rounding ...
        np.testing.assert_allclose(outputs[("matmul_nbits", 4)], outputs[("qdq", 0)], rtol=1e-5, atol=1e-5)

        # ... and float compute (level 0), which only the direct form offers, is closer to fp32.
        error = {key: float(((values - reference) ** 2).sum()) for key, values in outputs.items()}
        assert error[("matmul_nbits", 0)] < error[("matmul_nbits", 4)]


def test_gptq_codes_go_into_matmul_nbits(tmp_path):
    feeds = [{"input": np.load(p)[None]} for p in sorted(eval_dir("transformer").glob("*.npy"))[:8]]
    outputs = {}
    for form in ("qdq", "matmul_nbits"):
        config = NBITS % ("int4", form, ", algorithms: {rounding: gptq}")
        out, result = _quantize(tmp_path, sample("transformer"), calib_dir("transformer"), config, form)
        assert len(result.rewrite.algorithms) == 6
        assert all(names == ["gptq"] for names in result.rewrite.algorithms.values())
        level = "accuracy_level: 4, " if form == "matmul_nbits" else ""
        if level:  # compare at the accuracy level onnxruntime gives the fused QDQ form
            out, _ = _quantize(
                tmp_path,
                sample("transformer"),
                calib_dir("transformer"),
                config.replace("format", level + "format"),
                "l4",
            )
        outputs[form] = np.concatenate([run_model(out, f)[0].ravel() for f in feeds])
    np.testing.assert_allclose(outputs["matmul_nbits"], outputs["qdq"], rtol=1e-5, atol=1e-5)


def test_matmul_nbits_refuses_weights_it_cannot_hold_and_leaves_other_ops_as_qdq(tmp_path):
    config = tmp_path / "channel.yaml"
    config.write_text("global: {weight_only: true, weight: {dtype: int4, format: matmul_nbits}}\n")
    with pytest.raises(QtoolError, match=r"matmul_nbits stores the weight in blocks along K.*per_block"):
        qtool.quantize(sample("transformer"), tmp_path / "x.onnx", config_path=config, search=None, evaluation=None)
    config.write_text((NBITS % ("int4", "matmul_nbits", "")).replace("block_size: 16", "block_size: 24"))
    with pytest.raises(QtoolError, match=r"block_size 24 is not a power of two"):
        qtool.quantize(sample("transformer"), tmp_path / "x.onnx", config_path=config, search=None, evaluation=None)
    # The CNN's Conv layers stay in the QDQ form; its Gemm head (transB, bias) becomes MatMulNBits + Add.
    outputs = {}
    for form in ("qdq", "matmul_nbits"):
        config.write_text((NBITS % ("int4", form, "")).replace("format:", "final_layer_int8: false, format:"))
        out = tmp_path / f"cnn.{form}.onnx"
        result = qtool.quantize(sample("cnn"), out, config_path=config, search=None, evaluation=None)
        feeds = [{"input": np.load(p)[None]} for p in sorted(eval_dir("cnn").glob("*.npy"))[:4]]
        outputs[form] = np.concatenate([run_model(out, f)[0].ravel() for f in feeds])
    assert result.kernels == {"MatMulNBits": 1, "float Conv": 3}
    np.testing.assert_allclose(outputs["matmul_nbits"], outputs["qdq"], rtol=1e-4, atol=1e-4)


def test_awq_scales_outlier_channels_into_int4_weights_and_beats_rounding_to_nearest(tmp_path):
    rng = np.random.default_rng(3)
    k, n = 128, 96
    gains = np.ones(k, np.float32)
    gains[[5, 40, 77]] = 25.0  # outlier channels, as LLM and BERT activations have

    def inputs(count: int) -> np.ndarray:
        return (rng.normal(size=(count, 16, k)) * gains).astype(np.float32)

    graph = helper.make_graph(
        [
            helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1),
            helper.make_node("MatMul", ["h", "w"], ["y"], name="proj"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16, n])],
        [
            numpy_helper.from_array(gains, "gamma"),  # LayerNorm's scale carries the outliers, as in BERT
            numpy_helper.from_array(np.zeros(k, np.float32), "beta"),
            numpy_helper.from_array(rng.normal(0, 0.1, (k, n)).astype(np.float32), "w"),
        ],
    )
    model = tmp_path / "outliers.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i, sample_x in enumerate(inputs(16)):
        np.save(data / f"{i}.npy", sample_x[None])
    feeds = [{"x": x[None]} for x in inputs(16)]
    config = NBITS.replace("block_size: 16", "block_size: 32") % ("int4", "matmul_nbits", "%s")
    scores = {}
    for name, extra in (("nearest", ""), ("awq", ", algorithms: {awq: true}")):
        out, result = _quantize(tmp_path, model, data, config % extra, name)
        scores[name] = _sqnr(model, out, feeds)
    assert result.rewrite.algorithms == {"proj": ["awq"]}
    written = onnx.load(out)
    assert [n.op_type for n in written.graph.node] == ["LayerNormalization", "MatMulNBits"]  # 1/s went into the LN
    assert scores["awq"] > scores["nearest"] + 2.0, scores


def _encoder_feeds(directory: Path, limit: int = 16) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(path)) for path in sorted(directory.glob("*.npz"))[:limit]]


def _pooled_sqnr(candidate: Path, feeds: list[dict[str, np.ndarray]]) -> float:
    num = den = 0.0
    for feed in feeds:
        r, c = run_model(sample("encoder"), feed)[1], run_model(candidate, feed)[1]
        num, den = num + float((r**2).sum()), den + float(((r - c) ** 2).sum())
    return 10 * np.log10(num / den)


def test_the_bert_style_encoder_is_quantized_in_every_weight_form_by_default(tmp_path):
    out = tmp_path / "encoder.onnx"
    result = qtool.quantize(sample("encoder"), out, data_dir=calib_dir("encoder"), evaluation=None)
    # The tf2onnx-style layer's Einsum projections became MatMuls, the transposed key weight was folded.
    assert len(result.prepare.einsums_as_matmuls) == 4 and result.prepare.folded_weight_layouts
    assert "embeddings/word" in result.rewrite.quantized_nodes
    # the position (32 x 64) and token-type (2 x 64) tables are too small for storing them 8-bit to pay
    assert {name for name, _ in result.skipped} >= {"embeddings/position", "embeddings/type"}
    assert len(result.rewrite.quantized_weights) == 13  # the word table, 12 projections
    choice = result.placement_choice
    assert choice is not None and "dynamic" in {c.name for c in choice.candidates} | {
        a for c in choice.candidates for a in c.same_as
    }
    assert sample("encoder").stat().st_size / out.stat().st_size > 3.5
    assert _pooled_sqnr(out, _encoder_feeds(eval_dir("encoder"))) > 30


def test_the_encoder_runs_dynamic_without_data_and_int4_with_gptq(tmp_path):
    feeds = _encoder_feeds(eval_dir("encoder"))
    dynamic = tmp_path / "dynamic.onnx"
    result = qtool.quantize(
        sample("encoder"), dynamic, config_path=Path("configs/dynamic.yaml"), search=None, evaluation=None
    )
    assert result.calibration_samples == 0 and result.placements["dynamic"] == 14
    assert _pooled_sqnr(dynamic, feeds) > 30
    int4 = tmp_path / "int4.onnx"
    result = qtool.quantize(
        sample("encoder"),
        int4,
        config_path=Path("configs/int4_matmul_nbits.yaml"),
        data_dir=calib_dir("encoder"),
        search=None,
        evaluation=None,
    )
    assert result.kernels.get("MatMulNBits", 0) >= 8
    assert any("gptq" in names for names in result.rewrite.algorithms.values())
    # Embedding tables (most of this small model's weights) stay int8 in that config.
    assert sample("encoder").stat().st_size / int4.stat().st_size > 3.5
    assert _pooled_sqnr(int4, feeds) > 30


def test_block_scales_of_a_table_restored_at_load_are_stored_once_per_block(tmp_path):
    rng = np.random.default_rng(4)
    table = rng.normal(0, 0.05, (2000, 40)).astype(np.float32)  # 40 = 2 blocks of 16 and a partial one
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["y"], name="embed")],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 40])],
        [numpy_helper.from_array(table, "emb")],
    )
    model = tmp_path / "table.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    config = "op_type: {Gather: {weight: {dtype: int4, granularity: per_block, block_size: 16, symmetric: false}}}\n"
    out, result = _quantize(tmp_path, model, tmp_path, config, "blocks")
    assert result.calibration_samples == 0 and result.placements == {"lookup": 1}
    written = {i.name: list(i.dims) for i in onnx.load(out).graph.initializer}
    assert written["emb/scale"] == [2000, 3] and written["emb/zero_point"] == [2000, 3]
    # 4 bits per value, a float32 scale and an 8-bit zero point per 16 values: about 4.5x smaller.
    assert model.stat().st_size / out.stat().st_size > 4.3
    # What onnxruntime computes is the block-wise dequantized table, row for row.
    ids = rng.integers(0, 2000, (2, 8))
    got = run_model(out, {"ids": ids})[0]
    assert got.shape == (2, 8, 40)
    rows = table[ids]
    step = (rows.reshape(2, 8, -1).max() - rows.min()) / 15
    assert np.abs(got - rows).max() <= step  # within one step of the coarsest block's grid


def test_a_tiny_table_stays_float_and_a_shape_gather_is_no_lookup(tmp_path):
    # BERT's token-type table: two rows added to every token, one dimension 50 times the others; and the Gather
    # of a Shape that tf2onnx and torch exports are full of: neither is a table worth quantizing
    rng = np.random.default_rng(5)
    words = rng.normal(0, 0.05, (512, 32)).astype(np.float32)
    types = rng.normal(0, 0.02, (2, 32)).astype(np.float32)
    types[:, 7] = 1.0
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["words", "ids"], ["w"], name="word_embed"),
            helper.make_node("Gather", ["types", "zero"], ["t"], name="type_embed"),
            helper.make_node("Add", ["w", "t"], ["e"], name="add"),
            helper.make_node("Shape", ["e"], ["shape"], name="shape"),
            helper.make_node("Gather", ["shape", "zero"], ["batch"], name="batch_size", axis=0),
            helper.make_node("Reshape", ["e", "flat"], ["y"], name="flatten"),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 512]),
            helper.make_tensor_value_info("batch", TensorProto.INT64, []),
        ],
        [
            numpy_helper.from_array(words, "words"),
            numpy_helper.from_array(types, "types"),
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array([1, 512], np.int64), "flat"),
        ],
    )
    model = tmp_path / "tables.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = tmp_path / "calib"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", rng.integers(0, 512, (1, 16)))
    out, result = _quantize(tmp_path, model, data, "", "tables")
    assert result.rewrite.quantized_nodes == ["word_embed"]
    assert dict(result.skipped) == {"type_embed": "a table of 64 values: too small for storing it quantized to pay"}
    assert result.rewrite.passthrough.get("Gather") == 1  # the shape's Gather: passed through, not "kept in float"
    assert {i.name for i in onnx.load(out).graph.initializer} >= {"types"}
    feeds = [{"ids": rng.integers(0, 512, (1, 16))} for _ in range(4)]
    assert _sqnr(model, out, feeds) > 35
