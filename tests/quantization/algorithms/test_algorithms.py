"""The ``algorithms:`` config key on the sample models: GPTQ rounding and bias correction, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import qtool
from qtool.calibration.statistics import CalibrationStats
from qtool.errors import QtoolError
from qtool.quantization.algorithms.rounding.node_inputs import (
    FULL_PATCHES,
    LIGHT_PATCHES,
    MAX_REDUCTION,
    NodeInput,
    NodeInputCollector,
)
from qtool.quantization.algorithms.rounding.patches import MatMulGeometry
from tests.conftest import calib_dir, eval_dir, run_model, sample

INTEGER = "global: {placement: integer}\n"
GPTQ_BC = "global: {placement: integer, algorithms: {rounding: gptq, bias_correction: true}}\n"
INT4 = "global: {weight_only: true, weight: {dtype: int4}%s}\n"


def _sqnr(name: str, candidate: Path) -> float:
    num = den = 0.0
    for path in sorted(eval_dir(name).glob("*.npy"))[:32]:
        feed = {"input": np.load(path)[None]}
        r, c = run_model(sample(name), feed)[0], run_model(candidate, feed)[0]
        num, den = num + float((r**2).sum()), den + float(((r - c) ** 2).sum())
    return 10 * np.log10(num / den)


def _quantize(tmp_path: Path, name: str, config: str, tag: str, **kwargs):
    path = tmp_path / f"{tag}.yaml"
    path.write_text(config)
    out = tmp_path / f"{tag}.onnx"
    kwargs.setdefault("data_dir", calib_dir(name))
    result = qtool.quantize(sample(name), out, config_path=path, search=None, evaluation=None, **kwargs)
    return out, result


def test_gptq_and_bias_correction_raise_all_integer_accuracy_of_the_cnn(tmp_path):
    plain, _ = _quantize(tmp_path, "cnn", INTEGER, "plain")
    tuned, result = _quantize(tmp_path, "cnn", GPTQ_BC, "tuned")
    before, after = _sqnr("cnn", plain), _sqnr("cnn", tuned)
    assert after > before + 2.0, (before, after)  # measured 32.8 -> 37.9 dB
    applied = result.rewrite.algorithms
    assert set(applied) == set(result.rewrite.quantized_nodes)
    convs = {name: names for name, names in applied.items() if name != "head/gemm"}
    assert all(names == ["gptq", "bias_correction"] for names in convs.values())
    # the head has one output per sample: too few to estimate its mean error, so it is not corrected
    assert applied["head/gemm"] == ["gptq"]
    assert "too few" in result.rewrite.algorithm_notes["head/gemm"]
    # still every node an integer kernel: the same graph, other integers
    # (and the pools and the Flatten between them chained: MaxPool x2, GlobalAveragePool, Flatten)
    assert result.placements == {"integer": len(applied), "chained": 4}


@pytest.mark.slow
@pytest.mark.parametrize("rounding", ["gptq", "adaround"])
def test_learned_rounding_makes_int4_weights_of_the_cnn_much_more_accurate(tmp_path, rounding):
    nearest, _ = _quantize(tmp_path, "cnn", INT4 % "", "nearest")
    tuned, result = _quantize(tmp_path, "cnn", INT4 % f", algorithms: {{rounding: {rounding}}}", rounding)
    before, after = _sqnr("cnn", nearest), _sqnr("cnn", tuned)
    assert after > before + 6.0, (before, after)
    assert all(names == [rounding] for names in result.rewrite.algorithms.values())


@pytest.mark.slow
@pytest.mark.parametrize("config", [GPTQ_BC, GPTQ_BC.replace("gptq", "adaround")], ids=["gptq", "adaround"])
def test_the_same_inputs_give_the_same_bytes(tmp_path, config):
    first, _ = _quantize(tmp_path, "cnn", config, "first")
    second, _ = _quantize(tmp_path, "cnn", config, "second")
    assert first.read_bytes() == second.read_bytes()


def test_without_samples_the_weights_are_rounded_to_nearest_and_the_result_says_so(tmp_path):
    stats = tmp_path / "s.json"
    qtool.write_stats(qtool.calibrate(sample("cnn"), calib_dir("cnn")), stats)
    nearest, _ = _quantize(tmp_path, "cnn", INTEGER, "nearest", data_dir=None, stats_path=stats)
    out, result = _quantize(tmp_path, "cnn", GPTQ_BC, "nodata", data_dir=None, stats_path=stats)
    assert not result.rewrite.algorithms
    assert any("need calibration samples" in note for note in result.notes)
    assert out.read_bytes() == nearest.read_bytes()


def test_a_matmul_bias_add_and_a_storage_node_get_float_bias_corrections(tmp_path):
    config = "global: {placement: storage, algorithms: {bias_correction: true}}\n"
    out, result = _quantize(tmp_path, "transformer", config, "storage")
    corrected = [n for n, names in result.rewrite.algorithms.items() if "bias_correction" in names]
    assert corrected, result.rewrite.algorithm_notes
    model = onnx.load(str(out))
    assert any(i.name.endswith("/corrected") or i.name.endswith("/corrected_bias") for i in model.graph.initializer)
    run_model(out, {"input": np.load(sorted(eval_dir("transformer").glob("*.npy"))[0])[None]})


def test_a_float_input_node_gets_the_analytic_correction_whatever_the_other_nodes_do(tmp_path):
    # block1/conv reads float inputs (storage): its rounded weight alone shifts its mean, which the analytic
    # correction cancels from the float input means; the same bytes whether or not the others are integer
    storage = "node_name: {block1/conv: {placement: storage, algorithms: {rounding: gptq, bias_correction: true}}}\n"
    alone, _ = _quantize(tmp_path, "cnn", "global: {placement: storage}\n" + storage, "alone")
    mixed, result = _quantize(tmp_path, "cnn", GPTQ_BC + storage, "mixed")
    assert result.rewrite.algorithms["block1/conv"] == ["gptq", "bias_correction"]

    def block1_bias(path: Path) -> np.ndarray:
        model = onnx.load(str(path))
        conv = next(n for n in model.graph.node if n.name == "block1/conv")
        inits = {i.name: i for i in model.graph.initializer}
        return onnx.numpy_helper.to_array(inits[conv.input[2]])

    original = next(i for i in onnx.load(str(sample("cnn"))).graph.initializer if i.name == "block1.conv.bias")
    np.testing.assert_array_equal(block1_bias(alone), block1_bias(mixed))
    assert not np.array_equal(block1_bias(alone), onnx.numpy_helper.to_array(original))  # corrected


def test_the_collector_skips_nodes_whose_hessian_would_be_too_large():
    big = NodeInput("big", "MatMul", "x", MatMulGeometry(-1))
    small = NodeInput("small", "MatMul", "y", MatMulGeometry(-1))
    collector = NodeInputCollector([(big, (MAX_REDUCTION + 1, 8)), (small, (16, 8))], samples=100)
    assert "longer than" in collector.result.skipped["big"]
    assert collector.tensors == ["y"]
    rng = np.random.default_rng(0)
    for _ in range(100):
        collector.observe({"y": rng.standard_normal((1, 5, 16)).astype(np.float32)}, 1)
    stats = collector.result.stats["small"]
    # one sample in 7 looked at (at most 16 of the 100), every position of those in the mean
    assert stats.mean_count == 15 * 5 and stats.hessian_count == 15 * 5


def test_a_lighter_patch_budget_sums_fewer_patches_into_each_hessian():
    # the placement choice's own rounding (qtool.choice.rounded) reads a quarter of the patches a config's GPTQ does
    layers = [(NodeInput(f"n{k}", "MatMul", f"x{k}", MatMulGeometry(-1)), (k, 8)) for k in (16, 576, 2304)]
    full, light = NodeInputCollector(layers), NodeInputCollector(layers, patches=LIGHT_PATCHES)
    for name in full.positions:
        assert LIGHT_PATCHES.least <= light.positions[name] <= full.positions[name] <= FULL_PATCHES.most
    assert light.positions["n576"] == 8 * 576 and full.positions["n576"] == 32 * 576
    assert light.positions["n2304"] == LIGHT_PATCHES.most


def test_nodes_gptq_cannot_take_are_rounded_to_nearest_under_one_summary_line(tmp_path):
    from onnx import TensorProto, helper, numpy_helper
    from rich.console import Console

    from qtool.reports.tables import render_quantize

    k = MAX_REDUCTION + 96  # a reduction GPTQ's Hessian would be too large for
    rng = np.random.default_rng(3)
    nodes, inputs, outputs, inits = [], [], [], []
    for i in range(3):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 8]))
        inits.append(numpy_helper.from_array(rng.standard_normal((k, 8)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"], name=f"proj{i}"))
    graph = helper.make_graph(nodes, "wide", inputs, outputs, inits)
    model = tmp_path / "wide.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), model)
    data = tmp_path / "calib"
    data.mkdir()
    for j in range(4):
        np.savez(data / f"s{j}.npz", **{f"x{i}": rng.standard_normal((1, k)).astype(np.float32) for i in range(3)})
    config = tmp_path / "gptq.yaml"
    config.write_text(INT4 % ", algorithms: {rounding: gptq}")
    result = qtool.quantize(model, tmp_path / "q.onnx", config_path=config, data_dir=data, search=None, evaluation=None)
    reason = f"gptq: its reduction of {k} inputs is longer than {MAX_REDUCTION}"
    assert result.rewrite.algorithm_notes == {f"proj{i}": reason for i in range(3)}
    console = Console(record=True, width=200)
    render_quantize(console, result)
    assert f"not applied to 3 nodes: {reason}" in console.export_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("global: {algorithms: {rounding: best}}\n", "unknown rounding"),
        ("global: {algorithms: {smoothquant_alpha: 1.5}}\n", "migration strength"),
        ("op_type: {Conv: {algorithms: {bias_correction: 1}}}\n", "true or false"),
    ],
)
def test_bad_algorithm_settings_are_refused_at_their_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(QtoolError, match=message) as error:
        qtool.quantize(sample("cnn"), tmp_path / "o.onnx", config_path=path, data_dir=calib_dir("cnn"))
    assert f"{path}:1:" in error.value.message
    assert not (tmp_path / "o.onnx").exists()


def _outlier_model(folder: Path) -> tuple[Path, Path, Path]:
    """LayerNorm -> MatMul whose input has three outlier channels (100x the rest), with data."""
    rng = np.random.default_rng(3)
    k, n = 64, 32
    gamma = np.ones(k, np.float32)
    gamma[[5, 17, 40]] = 100.0
    inits = [
        onnx.numpy_helper.from_array(gamma, "gamma"),
        onnx.numpy_helper.from_array(np.zeros(k, np.float32), "beta"),
        onnx.numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32) * 0.1, "w"),
    ]
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("LayerNormalization", ["input", "gamma", "beta"], ["normed"], axis=-1, name="ln"),
            onnx.helper.make_node("MatMul", ["normed", "w"], ["output"], name="proj"),
        ],
        "outliers",
        [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 16, k])],
        [onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, [1, 16, n])],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    calib, evaluation = folder / "calib", folder / "eval"
    for directory, count in ((calib, 16), (evaluation, 8)):
        directory.mkdir()
        for i in range(count):
            np.save(directory / f"{i:02d}.npy", rng.standard_normal((16, k)).astype(np.float32))
    return path, calib, evaluation


def test_smoothquant_levels_outlier_channels_and_the_stats_file_reproduces_it(tmp_path):
    model, calib, evaluation = _outlier_model(tmp_path)
    configs = {}
    for tag, extra in (("plain", ""), ("smooth", ", algorithms: {smoothquant: true}")):
        configs[tag] = tmp_path / f"{tag}.yaml"
        configs[tag].write_text(f"global: {{placement: integer{extra}}}\n")
    outputs = {}
    for tag, config in configs.items():
        outputs[tag] = tmp_path / f"{tag}.onnx"
        qtool.quantize(model, outputs[tag], config_path=config, data_dir=calib, search=None, evaluation=None)
    errors = {}
    for tag, out in outputs.items():
        num = den = 0.0
        for path in sorted(evaluation.glob("*.npy")):
            feed = {"input": np.load(path)[None]}
            r, c = run_model(model, feed)[0], run_model(out, feed)[0]
            num, den = num + float((r**2).sum()), den + float(((r - c) ** 2).sum())
        errors[tag] = 10 * np.log10(num / den)
    assert errors["smooth"] > errors["plain"] + 4.0, errors  # measured 29.8 -> 35.7 dB
    # calibrate writes the channel ranges it smoothed with; quantize --stats smooths the same way
    stats = tmp_path / "s.json"
    qtool.write_stats(qtool.calibrate(model, calib, config_path=configs["smooth"]), stats)
    assert "normed" in CalibrationStats.read(stats).smoothing
    again = tmp_path / "again.onnx"
    qtool.quantize(model, again, config_path=configs["smooth"], stats_path=stats, search=None, evaluation=None)
    assert again.read_bytes() == outputs["smooth"].read_bytes()
    with pytest.raises(QtoolError, match="calibrated with SmoothQuant"):
        qtool.quantize(model, tmp_path / "x.onnx", config_path=configs["plain"], stats_path=stats, search=None)


def _uneven_conv_model(folder: Path) -> tuple[Path, Path, Path]:
    """Conv -> Relu -> Conv whose first layer's output channels span four decades of weight range."""
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    w1 *= np.logspace(-2, 2, 8, dtype=np.float32)[:, None, None, None]
    w2 = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    w2 /= np.logspace(-2, 2, 8, dtype=np.float32)[None, :, None, None]
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
            onnx.helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
            onnx.helper.make_node("Conv", ["r1", "w2", "b2"], ["output"], pads=[1, 1, 1, 1], name="conv2"),
        ],
        "uneven",
        [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 3, 12, 12])],
        [onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, [1, 4, 12, 12])],
        [
            onnx.numpy_helper.from_array(w1, "w1"),
            onnx.numpy_helper.from_array(np.full(8, 0.1, np.float32), "b1"),
            onnx.numpy_helper.from_array(w2, "w2"),
            onnx.numpy_helper.from_array(np.zeros(4, np.float32), "b2"),
        ],
    )
    path = folder / "model.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(path))
    calib, evaluation = folder / "calib", folder / "eval"
    for directory, count in ((calib, 8), (evaluation, 8)):
        directory.mkdir()
        for i in range(count):
            np.save(directory / f"{i:02d}.npy", rng.standard_normal((3, 12, 12)).astype(np.float32))
    return path, calib, evaluation


def test_equalization_rescues_per_tensor_weights_and_the_stats_file_records_it(tmp_path):
    model, calib, evaluation = _uneven_conv_model(tmp_path)
    base = "global: {placement: integer, weight: {granularity: per_tensor}%s}\n"
    configs = {"plain": base % "", "equalized": base % ", algorithms: {equalization: true}"}
    scores, results = {}, {}
    for tag, text in configs.items():
        config = tmp_path / f"{tag}.yaml"
        config.write_text(text)
        out = tmp_path / f"{tag}.onnx"
        results[tag] = qtool.quantize(model, out, config_path=config, data_dir=calib, search=None, evaluation=None)
        num = den = 0.0
        for path in sorted(evaluation.glob("*.npy")):
            feed = {"input": np.load(path)[None]}
            r, c = run_model(model, feed)[0], run_model(out, feed)[0]
            num, den = num + float((r**2).sum()), den + float(((r - c) ** 2).sum())
        scores[tag] = 10 * np.log10(num / den)
    assert scores["equalized"] > scores["plain"] + 10.0, scores
    assert results["equalized"].rewrite.algorithms == {"conv1": ["equalization"], "conv2": ["equalization"]}
    stats = tmp_path / "s.json"
    qtool.write_stats(qtool.calibrate(model, calib, config_path=tmp_path / "equalized.yaml"), stats)
    assert CalibrationStats.read(stats).equalized == ["conv1 -> conv2"]
    with pytest.raises(QtoolError, match="calibrated with cross-layer equalization"):
        qtool.quantize(model, tmp_path / "x.onnx", config_path=tmp_path / "plain.yaml", stats_path=stats, search=None)


@pytest.mark.slow
def test_the_cli_names_the_algorithms_in_inspect_and_in_the_quantize_json(tmp_path):
    from typer.testing import CliRunner

    from qtool.cli import app

    config = tmp_path / "c.yaml"
    config.write_text(GPTQ_BC)
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(sample("cnn")), "--config", str(config), "--json", "-"])
    assert shown.exit_code == 0, shown.output
    nodes = json.loads(shown.stdout)["nodes"]
    weighted = [node for node in nodes if node["placement"] != "chained"]  # a chained op has no weight to round
    assert weighted and all(node["algorithms"] == ["gptq", "bias_correction"] for node in weighted)
    assert all(node["algorithms"] == [] for node in nodes if node["placement"] == "chained")
    out = tmp_path / "q.onnx"
    args = ["quantize", str(sample("cnn")), "--data", str(calib_dir("cnn")), "--config", str(config)]
    done = runner.invoke(app, [*args, "-o", str(out), "--no-search", "--runs", "0", "--json", "-"])
    assert done.exit_code == 0, done.output
    document = json.loads(done.stdout)
    assert document["algorithms"]["applied"]["block1/conv"] == ["gptq", "bias_correction"]
    assert "head/gemm" in document["algorithms"]["not_applied"]


def test_bias_correction_with_no_measurable_layer_in_a_candidate_does_not_crash(tmp_path):
    """The encoder's dynamic candidate asks for bias correction where no layer can be measured (it crashed)."""
    out = tmp_path / "enc.onnx"
    search = qtool.SearchOptions(latency_runs=0)
    config = Path(__file__).parents[3] / "configs" / "accurate.yaml"
    result = qtool.quantize(
        sample("encoder"), out, config_path=config, data_dir=calib_dir("encoder"), search=search, evaluation=None
    )
    assert result.placement_choice is not None and "dynamic" in {c.name for c in result.placement_choice.candidates}
    assert onnx.load(str(out)).graph.node


def test_measuring_bias_shifts_of_no_layer_measures_nothing():
    from qtool.graph.weights import Weights
    from qtool.quantization.algorithms.rounding.empirical_bias import measure_shifts

    model = onnx.load(str(sample("mlp")))
    assert measure_shifts(model, Weights(), [], [{"input": np.zeros((1, 64), np.float32)}]) == ({}, {})


def test_the_mean_patches_are_summed_where_bias_correction_reads_them_and_only_there():
    from qtool.choice.tune.space import GPTQ, GPTQ_BC
    from qtool.config import load_config
    from qtool.pipeline.build import input_collector
    from qtool.pipeline.workspace import open_workspace

    ws = open_workspace(sample("cnn"), load_config())
    # tune's collector serves its options with bias correction too (w8g, w8bg): it must sum the means
    with_bc = input_collector(ws, ws.config.with_rules(global_=GPTQ_BC))
    gptq_only = input_collector(ws, ws.config.with_rules(global_=GPTQ))
    assert with_bc is not None and gptq_only is not None and with_bc.means and not gptq_only.means
