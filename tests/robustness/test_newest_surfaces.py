"""The promises on the newest surfaces (issue 45): fp8 across the config's levels, float16 edges, numbers at the
edges, names, configs by name, tune's targets, statistics read whole, notes true to the run.

Each class: a bad input is one clear line naming the file, line or tensor, exit 2 and nothing written; what
the model allows is done; exit 70 stays for bugs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import calib_dir, eval_dir, sample

runner = CliRunner()
CNN = sample("cnn")


def _refused(args: list[object], needle: str, outputs: tuple[Path, ...] = ()) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.output
    assert not any(path.exists() for path in outputs)
    return errors[0]


# ---------------------------------------------------------------- fp8 rules across the config's levels
@pytest.mark.parametrize(
    ("rule", "setting", "line"),
    [
        ("block1/conv", "weight: {granularity: per_block}", 5),
        ("head/gemm", "weight: {format: matmul_nbits}", 5),
    ],
)
def test_fp8_from_an_op_type_rule_meets_a_node_name_rule_at_its_yaml_line(
    tmp_path: Path, rule: str, setting: str, line: int
) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(
        "op_type:\n"
        "  Conv: {weight: {dtype: fp8_e4m3}, activation: {dtype: fp8_e4m3}}\n"
        "  Gemm: {weight: {dtype: fp8_e4m3}, activation: {dtype: fp8_e4m3}}\n"
        "node_name:\n"
        f'  "{rule}": {{{setting}}}\n'
    )
    out = tmp_path / "q.onnx"
    error = _refused(["quantize", CNN, "--config", config, "-o", out], f"rules.yaml:{line}:", (out,))
    op = "Conv" if "conv" in rule else "Gemm"
    assert f"rule op_type:{op}" in error and f"rule node_name:{rule}" in error and f"node '{rule}'" in error


def test_a_node_name_rule_with_its_own_dtype_is_not_an_fp8_conflict(tmp_path: Path) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(
        "op_type:\n  Conv: {weight: {dtype: fp8_e4m3}, activation: {dtype: fp8_e4m3}}\n"
        'node_name:\n  "block1/conv": {weight: {dtype: int8, granularity: per_block, block_size: 32}}\n'
    )
    r = runner.invoke(app, ["inspect", str(CNN), "--config", str(config)])
    assert r.exit_code == 0, r.output
    assert "fp8" in r.output and "per_block" in r.output


@pytest.mark.slow
def test_tune_with_the_installed_fp8_config_writes_a_config_that_reads_back(tmp_path: Path) -> None:
    out, chosen = tmp_path / "t.onnx", tmp_path / "t.yaml"
    args = ["tune", CNN, "--config", "fp8", "-o", out, "--config-out", chosen, "--data", calib_dir("cnn")]
    args += ["--eval", eval_dir("cnn"), "--target-sqnr", "20", "--time-budget", "30", "--no-cache"]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    again = tmp_path / "again.onnx"
    r = runner.invoke(
        app, ["quantize", str(CNN), "--config", str(chosen), "--data", str(calib_dir("cnn")), "-o", str(again)]
    )
    assert r.exit_code == 0, r.output
    assert again.read_bytes() == out.read_bytes()


# ---------------------------------------------------------------- float16 models
def _float16_with_sparse_bias(path: Path, data: Path) -> None:
    weight = (np.random.default_rng(0).standard_normal((16, 8)) * 0.3).astype(np.float16)
    values = numpy_helper.from_array(np.array([0.5, -1.0], np.float16), "values")
    bias = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([1, 5], np.int64), "indices"), [8])
    nodes = [
        helper.make_node("Constant", [], ["bias"], sparse_value=bias, name="bias"),
        helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "bias"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "sparse_bias",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", 8])],
        [numpy_helper.from_array(weight, "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(data / f"{i}.npy", rng.standard_normal(16).astype(np.float16))


def test_a_float16_model_with_a_sparse_constant_is_quantized(tmp_path: Path) -> None:
    model, data, out = tmp_path / "m.onnx", tmp_path / "data", tmp_path / "q.onnx"
    _float16_with_sparse_bias(model, data)
    r = runner.invoke(app, ["quantize", str(model), "--data", str(data), "-o", str(out)])
    assert r.exit_code == 0, r.output
    x = np.load(data / "0.npy")[None]
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    assert got.dtype == np.float16 and np.abs(got.astype(np.float32) - want).max() < 0.05


def test_the_tensorrt_cache_of_a_float16_model_names_its_own_tensors(tmp_path: Path) -> None:
    model, data, cache = tmp_path / "m.onnx", tmp_path / "data", tmp_path / "trt.cache"
    _float16_with_sparse_bias(model, data)
    args = ["calibrate", str(model), str(data), "-o", str(tmp_path / "s.json"), "--tensorrt-cache", str(cache)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    names = {line.split(":")[0] for line in cache.read_text().splitlines()[1:]}
    graph = onnx.load(model).graph
    tensors = {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    assert names and names <= tensors and "x" in names


# ---------------------------------------------------------------- numbers at the edges
def _cnn_with_first_conv_weight(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> str:
    model = onnx.load(CNN)
    init = next(i for i in model.graph.initializer if len(i.dims) == 4)
    init.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(init).copy()), init.name))
    onnx.save(model, path)
    return init.name


def test_weights_near_float_range_quantize_and_score_in_the_default(tmp_path: Path) -> None:
    """Outputs of ~1e30 overflow float32 energies: the scoring sums them in float64, no exit 70."""
    model, out, report = tmp_path / "big.onnx", tmp_path / "q.onnx", tmp_path / "q.json"
    _cnn_with_first_conv_weight(model, lambda w: (w * 1e30).astype(np.float32))
    args = ["quantize", model, "--data", calib_dir("cnn"), "-o", out, "--json", report]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["comparison"]["accuracy"]["overall"]["sqnr_db"] > 30


@pytest.mark.parametrize("config", ["integer", "default"])
def test_a_nan_weight_is_named_before_calibration(tmp_path: Path, config: str) -> None:
    model, out = tmp_path / "nan.onnx", tmp_path / "q.onnx"

    def poison(w: np.ndarray) -> np.ndarray:
        w.flat[3] = np.nan
        return w

    name = _cnn_with_first_conv_weight(model, poison)
    args = ["quantize", model, "--config", config, "--data", calib_dir("cnn"), "-o", out]
    error = _refused(list(args), f"weight '{name}'", (out,))
    assert "NaN or Inf" in error and "calibrate" not in error


def _tune(tmp_path: Path, *extra: object) -> list[object]:
    out, chosen = tmp_path / "t.onnx", tmp_path / "t.yaml"
    return [
        "tune",
        CNN,
        "--data",
        calib_dir("cnn"),
        "--eval",
        eval_dir("cnn"),
        "-o",
        out,
        "--config-out",
        chosen,
        *extra,
    ]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_tune_refuses_a_target_metric_no_metric_can_reach(tmp_path: Path, value: str) -> None:
    (tmp_path / "task.py").write_text("def score(reference, candidate):\n    return 1.0\n")
    args = _tune(tmp_path, "--metric", "task:score", "--target-metric", value)
    _refused(args, "--target-metric", (tmp_path / "t.onnx", tmp_path / "t.yaml"))


@pytest.mark.parametrize("steps", ["-5", "0", "100000"])
def test_tune_refuses_decode_steps_out_of_range_whatever_the_goal(tmp_path: Path, steps: str) -> None:
    args = _tune(tmp_path, "--target-sqnr", "30", "--decode-steps", steps)
    _refused(args, "--decode-steps", (tmp_path / "t.onnx", tmp_path / "t.yaml"))


def test_a_kv_cache_granularity_lists_the_kv_caches_own_choices(tmp_path: Path) -> None:
    config = tmp_path / "kv.yaml"
    config.write_text("kv_cache: {dtype: int8, granularity: per_block}\n")
    error = _refused(["inspect", sample("decoder"), "--config", config], "kv.yaml:1:")
    assert "per_tensor, per_channel)" in error and "per_block)" not in error


@pytest.fixture(scope="module")
def baseline_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("baseline")
    report = folder / "base.json"
    r = runner.invoke(
        app, ["compare", str(CNN), str(CNN), "--data", str(eval_dir("cnn")), "--runs", "10", "--json", str(report)]
    )
    assert r.exit_code == 0, r.output
    return folder, json.loads(report.read_text())


@pytest.mark.parametrize(
    ("field", "value"), [("latency_ratio", -1), ("latency_ratio", 0), ("latency_ratio_interval", [1.2, 0.8])]
)
def test_a_baseline_whose_latency_is_not_a_ratio_of_times_is_refused(
    baseline_report: tuple[Path, dict], field: str, value: object
) -> None:
    folder, report = baseline_report
    broken = json.loads(json.dumps(report))
    broken["latency"][0][field] = value
    path = folder / f"{field}-{value}.json"
    path.write_text(json.dumps(broken))
    args = ["compare", CNN, CNN, "--data", eval_dir("cnn"), "--runs", "10", "--baseline", path]
    for _ in range(2):  # the same answer every run
        assert field in _refused(list(args), path.name)


# ---------------------------------------------------------------- names reaching the terminal
@pytest.mark.slow
def test_tunes_sample_lines_escape_file_names(tmp_path: Path) -> None:
    hostile = tmp_path / "eval"
    hostile.mkdir()
    names = ["\x1b[2Jclear.npy", "a\nerror: forged.npy", "[reverse]styled.npy"]
    for index, path in enumerate(sorted(eval_dir("cnn").glob("*.npy"))[:16]):
        (hostile / (names[index] if index < len(names) else path.name)).write_bytes(path.read_bytes())
    out, chosen = tmp_path / "t.onnx", tmp_path / "t.yaml"
    args = ["tune", CNN, "--data", calib_dir("cnn"), "--eval", hostile, "-o", out, "--config-out", chosen]
    r = runner.invoke(app, [str(a) for a in [*args, "--target-sqnr", "20", "--time-budget", "20", "--no-cache"]])
    assert r.exit_code in (0, 1), r.output
    assert "\x1b" not in r.output and "[reverse]" in r.output
    assert not any(line.startswith("error: forged") for line in r.output.splitlines())
    assert "samples: EVAL split in two" in r.output


# ---------------------------------------------------------------- configs by name
def test_a_broken_link_named_like_an_installed_config_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp16.yaml").symlink_to(tmp_path / "gone.yaml")
    out = tmp_path / "q.onnx"
    for name in ("fp16.yaml", "fp16"):
        assert "broken symbolic link" in _refused(["quantize", CNN, "--config", name, "-o", out], "fp16.yaml", (out,))


def test_a_local_file_wins_over_the_installed_config_of_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp16.yaml").write_text("global: {weight: {dtype: int4, granularity: per_block, block_size: 32}}\n")
    r = runner.invoke(app, ["inspect", str(CNN), "--config", "fp16"])
    assert r.exit_code == 0, r.output
    assert "int4" in r.output and "fp16" not in r.output.replace("fp16.yaml", "")


# ---------------------------------------------------------------- tune's targets lowered as quantize lowers them
@pytest.mark.slow
def test_tune_for_tensorrt_keeps_an_opset_17_model_with_layer_normalization(tmp_path: Path) -> None:
    model = sample("transformer")
    assert any(n.op_type == "LayerNormalization" for n in onnx.load(model).graph.node)
    out, chosen = tmp_path / "t.onnx", tmp_path / "t.yaml"
    args = ["tune", model, "--target", "tensorrt", "--data", calib_dir("transformer"), "--eval"]
    args += [eval_dir("transformer"), "-o", out, "--config-out", chosen, "--target-sqnr", "20", "--no-cache"]
    r = runner.invoke(app, [str(a) for a in [*args, "--time-budget", "30"]])
    assert r.exit_code == 0, r.output
    assert onnx.load(out).opset_import[0].version >= 17
    assert ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_inputs()


# ---------------------------------------------------------------- statistics read whole
@pytest.fixture(scope="module")
def cnn_stats(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("stats") / "stats.json"
    r = runner.invoke(app, ["calibrate", str(CNN), str(calib_dir("cnn")), "-o", str(path)])
    assert r.exit_code == 0, r.output
    return json.loads(path.read_text())


@pytest.mark.parametrize(("label", "value"), [("a list", [0.0, 1.0]), ("empty", []), ("above max", 1e6)])
def test_a_wrong_statistics_file_is_refused_whatever_the_plan_uses(
    cnn_stats: dict, tmp_path: Path, label: str, value: object
) -> None:
    broken = json.loads(json.dumps(cnn_stats))
    tensor = sorted(broken["tensors"])[0]
    broken["tensors"][tensor]["state"]["min"] = value
    stats, out = tmp_path / "stats.json", tmp_path / "q.onnx"
    stats.write_text(json.dumps(broken))
    # weights only: no activation range is ever computed, and the file is still refused
    config = tmp_path / "w.yaml"
    config.write_text("global: {weight_only: true}\n")
    error = _refused(["quantize", CNN, "--stats", stats, "--config", config, "-o", out], "stats.json", (out,))
    assert repr(tensor) in error


# ---------------------------------------------------------------- notes true to the run
def test_dynamic_mode_says_which_nodes_run_statically(tmp_path: Path) -> None:
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    args = ["quantize", CNN, "--config", "dynamic", "--data", calib_dir("cnn"), "-o", out, "--json", report]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    notes = json.loads(report.read_text())["notes"]
    assert any("3 Conv quantized statically" in n for n in notes), notes


def _choice(candidates: list, chosen: str, validations: tuple = ()) -> object:  # a PlacementChoice
    from qtool.choice.records import PlacementChoice

    return PlacementChoice(30.0, ["a.npy"], 1, candidates, chosen, "", fp32_ms=1.0, validations=list(validations))


def test_the_no_speedup_note_names_the_faster_placement_the_table_shows() -> None:
    from qtool.choice.records import PlacementRound
    from qtool.choice.validated import Validation
    from qtool.reports.placement_tables import _no_speedup_note
    from tests.choice.records import candidate

    integer = candidate("integer", 4, 0, 31.0, True, 1 / 1.32)
    storage = candidate("storage", 0, 4, 36.0, True, 1.0)
    missed = PlacementRound("integer", Validation(["b.npy"], 29.0, 28.5, meets=False))
    note = _no_speedup_note(_choice([integer, storage], "storage", (missed,)))  # type: ignore[arg-type]
    assert "integer 1.32x (on the validation samples)" in note and "no placement measured" not in note
    assert note.endswith("its weights are stored quantized")


def test_the_no_speedup_note_does_not_claim_stored_weights_when_none_is() -> None:
    from qtool.reports.placement_tables import _no_speedup_note
    from tests.choice.records import candidate

    only = candidate("auto", 0, 0, 99.0, True, 1.0, same_as=["integer", "storage"])
    note = _no_speedup_note(_choice([only], "auto"))  # type: ignore[arg-type]
    assert "stored quantized" not in note and note.endswith("no node runs an integer kernel")
    assert "no placement measured more than 10% faster" in note


def test_the_no_speedup_note_does_not_claim_a_measurement_when_nothing_was_timed() -> None:
    from dataclasses import replace

    from qtool.reports.placement_tables import _no_speedup_note
    from tests.choice.records import candidate

    # fp16 weights: every candidate plans the same model, so nothing is timed (and no node runs an integer kernel)
    only = candidate("auto", 0, 0, 64.0, True, None, same_as=["integer", "storage"])
    untimed = replace(_choice([only], "auto"), fp32_ms=None, timing_note="every placement plans the same model")  # type: ignore[type-var]
    note = _no_speedup_note(untimed)
    assert note.startswith("nothing was timed (every placement plans the same model)") and "measured" not in note
