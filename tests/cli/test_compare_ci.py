"""compare for CI: per-layer debugging, classification agreement, providers, reports and gates."""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET

import onnxruntime as ort
import pytest
import yaml
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.graph.model_files import file_sha256
from qtool.options import EvaluationOptions
from qtool.reports.ci import to_markdown
from tests.conftest import ROOT, calib_dir, eval_dir, sample

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def cnn_with_one_int2_layer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int2")
    config = folder / "c.yaml"
    # No sensitivity search: it would give the damaged layer float activations and hide it.
    config.write_text("node_name: {block1/conv: {weight: {dtype: int2}}}\naccuracy: {target_sqnr_db: null}\n")
    out = folder / "cnn.onnx"
    qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), config_path=config, evaluation=None)
    return out


@pytest.fixture(scope="module")
def cnn_int8(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "cnn.onnx"
    qtool.quantize(sample("cnn"), out, data_dir=calib_dir("cnn"), evaluation=None)
    return out


def test_per_layer_report_names_the_layer_forced_to_int2(cnn_with_one_int2_layer, tmp_path):
    r = invoke(
        "compare",
        sample("cnn"),
        cnn_with_one_int2_layer,
        "--data",
        eval_dir("cnn"),
        "--per-layer",
        "--runs",
        "0",
        "--json",
        "-",
    )
    assert r.exit_code == 0, r.stderr
    per_layer = json.loads(r.stdout)["per_layer"]
    assert per_layer["largest_drop"]["node"] == "block1/conv"
    layers = per_layer["layers"]
    assert layers == sorted(layers, key=lambda x: x["sqnr_db"])  # worst first
    by_tensor = {x["tensor"]: x for x in layers}
    # the float names survive the rewrite: every stage of the CNN is paired
    assert {"block0/relu_out", "block1/bn_out", "block2/relu_out", "gap_out", "logits"} <= set(by_tensor)
    assert by_tensor["block0/relu_out"]["sqnr_db"] > 30 > by_tensor["block1/bn_out"]["sqnr_db"]
    assert "largest drop: block1/conv" in r.stderr


def test_plot_draws_a_png(cnn_with_one_int2_layer, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "layers.png"
    r = invoke(
        "compare", sample("cnn"), cnn_with_one_int2_layer, "--data", eval_dir("cnn"), "--runs", "0", "--plot", png
    )
    assert r.exit_code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # the worst bar carries the node name the text report blames
    assert "largest drop: block1/conv" in r.stdout + r.stderr


def _png_size(path):
    import struct

    return struct.unpack(">II", path.read_bytes()[16:24])


def test_plot_shows_drops_and_stays_readable_for_hundreds_of_layers(tmp_path):
    pytest.importorskip("matplotlib")
    from qtool.reports.plot import chart_layers, plot_layers
    from qtool.schemas.reports.compare import Layer

    def row(i, drop, uncertain=None):
        return Layer(
            tensor=f"t{i}",
            node=f"node{i}",
            op_type="Conv",
            sqnr_db=100.0 if i == 0 else 30.0,
            mse=0.0,
            cosine=1.0,
            input_sqnr_db=40.0,
            drop_db=None if uncertain else drop,
            position=i,
            folded=["Relu"] if i == 7 else [],
            uncertain=uncertain,
        )

    # a capped 100 dB tensor no longer flattens the rest: drops are drawn, not absolute SQNR
    layers = [row(i, float(i % 13) / 4) for i in range(600)]
    layers[7] = row(7, 25.0)
    layers[300] = row(300, 40.0, uncertain="named like another tensor")
    chart = chart_layers(layers, top=20)
    assert len(chart.drops) == 599 and chart.uncertain == 1
    assert chart.worst[0] == (7, "node7 (Conv+Relu)", 25.0) and len(chart.worst) == 20
    assert [d for _, _, d in chart.worst] == sorted((d for _, _, d in chart.worst), reverse=True)
    png = tmp_path / "many.png"
    plot_layers(layers, png)
    width, height = _png_size(png)
    assert width <= 1200 and height <= 1200  # the same figure for 600 layers as for 20


def test_plot_without_matplotlib_is_a_clear_error_before_any_work(cnn_int8, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = invoke("compare", sample("cnn"), cnn_int8, "--data", eval_dir("cnn"), "--plot", tmp_path / "p.png")
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.stderr and "qtool-onnx[plot]" in r.stderr
    assert not (tmp_path / "p.png").exists()


def test_classification_is_auto_detected_on_the_cnn_and_not_on_the_transformer(cnn_int8, tmp_path):
    result = qtool.compare(sample("cnn"), cnn_int8, eval_dir("cnn"), options=EvaluationOptions(runs=0))
    assert result.task == "classification: 'logits' ([N,10] logits from Gemm)"
    (agreement,) = result.classification
    assert agreement.output == "logits" and agreement.rows == 32 and 0.9 <= agreement.top1 <= agreement.top5 == 1.0
    q = tmp_path / "t.onnx"
    qtool.quantize(sample("transformer"), q, data_dir=calib_dir("transformer"), evaluation=None)
    plain = qtool.compare(sample("transformer"), q, eval_dir("transformer"), options=EvaluationOptions(runs=0))
    assert plain.classification == [] and plain.task == "error metrics only: 'output' ([N,16,64], not class scores)"
    forced = qtool.compare(
        sample("transformer"), q, eval_dir("transformer"), options=EvaluationOptions(runs=0, task="classification")
    )
    assert forced.classification and forced.classification[0].rows == 32 * 16  # every [seq, d] row of every sample


GATES = [
    (["--fail-under", "sqnr=30"], ["--fail-under", "sqnr=60"]),
    (["--fail-under", "cosine=0.99"], ["--fail-under", "cosine=0.999999"]),
    (["--fail-under", "top1=0.9"], None),  # agreement is 100 % here: no reachable threshold fails
    (["--fail-under", "top5=1.0"], None),
    (["--fail-over", "mse=1.0"], ["--fail-over", "mse=1e-9"]),
    (["--fail-over", "max_abs_error=5"], ["--fail-over", "max_abs_error=1e-6"]),
    (["--min-compression", "3.5"], ["--min-compression", "10"]),
    (["--max-latency-ratio", "100"], ["--max-latency-ratio", "0.001"]),
]


@pytest.mark.parametrize(("passing", "failing"), GATES, ids=[g[0][1].split("=")[0] for g in GATES])
def test_each_gate_passes_and_fires(cnn_int8, tmp_path, passing, failing):
    base = ["compare", sample("cnn"), cnn_int8, "--data", eval_dir("cnn"), "--runs", "5", "--warmup", "1"]
    ok = invoke(*base, *passing)
    assert ok.exit_code == 0, ok.stderr
    if failing is None:
        return
    bad = invoke(*base, *failing, "--json", tmp_path / "r.json")
    assert bad.exit_code == 1, bad.stderr
    assert "FAIL" in bad.stdout and "gates failed" in bad.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["gates"]["passed"] is False and doc["gates"]["results"][0]["passed"] is False


@pytest.mark.parametrize(
    "gate",
    [["--fail-under", "sqnr"], ["--fail-under", "speed=2"], ["--fail-over", "mse=abc"], ["--fail-over", "sqnr=1"]],
)
def test_malformed_gates_are_usage_errors(cnn_int8, gate):
    r = invoke("compare", sample("cnn"), cnn_int8, "--data", eval_dir("cnn"), *gate)
    assert r.exit_code == 2 and r.stderr.startswith("error: --fail-")


def test_every_gate_is_printed_and_written_to_junit_and_markdown(cnn_int8, tmp_path):
    junit, markdown = tmp_path / "gates.xml", tmp_path / "report.md"
    r = invoke(
        "compare",
        sample("cnn"),
        cnn_int8,
        "--data",
        eval_dir("cnn"),
        "--runs",
        "3",
        "--fail-under",
        "sqnr=25",
        "--fail-under",
        "sqnr=99",
        "--min-compression",
        "3",
        "--junit",
        junit,
        "--markdown",
        markdown,
    )
    assert r.exit_code == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["sqnr >= 25", "sqnr >= 99", "compression >= 3"]
    assert [c.find("failure") is not None for c in cases] == [False, True, False]
    assert suite.get("failures") == "1" and suite.get("tests") == "3"
    text = markdown.read_text()
    assert "**Gates FAILED** (1 of 3 failed)" in text and "| `sqnr >= 99` |" in text and "### Latency" in text


def test_unavailable_providers_are_skipped_with_a_reason_and_unknown_ones_refused(cnn_int8):
    r = invoke(
        "compare",
        sample("cnn"),
        cnn_int8,
        "--data",
        eval_dir("cnn"),
        "--runs",
        "3",
        "--providers",
        "cpu,cuda,TensorrtExecutionProvider",
        "--json",
        "-",
    )
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    measured = [lat["provider"] for lat in doc["latency"]]
    skipped = {s["provider"]: s["reason"] for s in doc["skipped_providers"]}
    available = ort.get_available_providers()
    for name in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        assert (name in measured) != (name in skipped)  # every provider asked for is measured or said skipped
        if name not in available:
            assert "not available in this onnxruntime build" in skipped[name]
        elif name in skipped:  # built in but unable to start here (TensorRT without its libraries)
            assert "could not start it" in skipped[name] or "cannot load" in skipped[name]
    assert measured[0] == "CPUExecutionProvider"
    r = invoke("compare", sample("cnn"), cnn_int8, "--data", eval_dir("cnn"), "--providers", "cpu,quantum")
    assert r.exit_code == 2 and "unknown execution provider 'quantum'" in r.stderr


def test_json_carries_the_reproducibility_block(cnn_int8, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("version: 1\n")
    r = invoke(
        "compare",
        sample("cnn"),
        cnn_int8,
        "--data",
        eval_dir("cnn"),
        "--runs",
        "2",
        "--threads",
        "1",
        "--config",
        config,
        "--json",
        "-",
    )
    repro = json.loads(r.stdout)["reproducibility"]
    assert repro["reference_sha256"] == file_sha256(sample("cnn"))
    assert repro["config_sha256"] == file_sha256(config)
    assert len(repro["data"]["sha256"]) == 64 and repro["data"]["files"] == 32
    assert set(repro["versions"]) >= {"qtool", "onnx", "onnxruntime", "numpy"}
    assert repro["cpu"]["model"] and isinstance(repro["cpu"]["flags"], list)
    assert repro["threads"]["intra_op"] == 1 and repro["providers_measured"] == ["CPUExecutionProvider"]
    again = json.loads(
        invoke("compare", sample("cnn"), cnn_int8, "--data", eval_dir("cnn"), "--runs", "0", "--json", "-").stdout
    )["reproducibility"]
    assert again["data"]["sha256"] == repro["data"]["sha256"]


@pytest.mark.gpu
def test_cuda_latency_is_measured_on_a_gpu_machine(cnn_int8):
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("no CUDA execution provider here (CI has no GPU)")
    result = qtool.compare(
        sample("cnn"),
        cnn_int8,
        eval_dir("cnn"),
        options=EvaluationOptions(runs=20, providers=tuple(["CUDAExecutionProvider"])),
    )
    assert [lat.provider for lat in result.latency] == ["CUDAExecutionProvider"]
    assert result.latency[0].reference.median_ms > 0


def test_github_actions_example_is_valid_and_runs_real_commands():
    workflow = yaml.safe_load((ROOT / "examples" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["quantize"]["steps"]
    lines = [line.strip() for s in steps if "run" in s for line in s["run"].replace("\\\n", " ").splitlines()]
    commands = [line for line in lines if line.startswith("qtool")]
    assert {c.split()[1] for c in commands} == {"calibrate", "quantize", "compare"}
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)
    for command in commands:
        words = shlex.split(command.replace("\n", " "))
        subcommand = words[1]
        help_text = invoke(subcommand, "--help").stdout
        for option in (w.split("=")[0] for w in words if w.startswith("--")):
            assert option in help_text, f"{subcommand} has no option {option}"
    steps = "\n".join(lines)
    assert "baseline=(--baseline baseline/report.json)" in steps and "baseline+=(--fail-on-regression)" in steps


@pytest.mark.parametrize(
    ("gate", "message"),
    [
        (["--fail-under", "top1=99"], "top1 is a fraction: 0.99 means 99 %"),
        (["--fail-under", "cosine=1.5"], "cosine lies in [-1, 1]"),
        (["--fail-over", "mse=-1"], "mse=-1 can never be measured"),
        (["--max-latency-ratio", "0"], "a ratio gate needs a positive value"),
        (["--max-latency-ratio", "1.0", "--runs", "0"], "a latency gate with --runs 0"),
        (["--fail-under", "top1=0.9", "--task", "none"], "a top1 gate with --task none"),
        (["--latency-tolerance", "5%"], "--latency-tolerance without a latency gate"),
        (["--max-latency-ratio", "1", "--latency-tolerance", "lots"], "--latency-tolerance: 'lots' is not a number"),
    ],
)
def test_gates_that_cannot_mean_what_was_meant_are_refused_before_any_work(tmp_path, gate, message):
    out = tmp_path / "r.json"
    r = invoke("compare", sample("mlp"), sample("mlp"), "--data", eval_dir("mlp"), *gate, "--json", out)
    assert r.exit_code == 2 and message in r.stderr, r.stderr
    assert not out.exists() and "accuracy" not in r.stdout


def test_latency_interval_is_reported_and_judged(tmp_path):
    r = invoke(
        "compare",
        sample("mlp"),
        sample("mlp"),
        "--data",
        eval_dir("mlp"),
        "--runs",
        "60",
        "--warmup",
        "2",
        "--max-latency-ratio",
        "1.0",
        "--latency-tolerance",
        "5%",
        "--json",
        tmp_path / "r.json",
    )
    doc = json.loads((tmp_path / "r.json").read_text())
    latency = doc["latency"][0]
    low, high = latency["latency_ratio_interval"]
    assert low <= latency["latency_ratio"] <= high
    assert latency["speedup_interval"] == pytest.approx([1 / high, 1 / low])
    gate = doc["gates"]["results"][0]
    assert gate["passed"] == (low <= 1.05) and r.exit_code == (0 if low <= 1.05 else 1)
    assert "99 % interval" in r.stdout


@pytest.mark.slow
def test_a_model_at_reference_speed_passes_a_ratio_1_gate_19_times_in_20(tmp_path):
    # The candidate is a byte copy of the reference: the same speed by construction. With the default
    # runs and tolerance, a latency gate at 1.0 must not fail on noise more than once in 20 runs.
    from qtool.evaluation.gates import parse_gates

    copy = tmp_path / "copy.onnx"
    copy.write_bytes(sample("mlp").read_bytes())
    gates = parse_gates(max_latency_ratio=1.0)
    passed = 0
    for _ in range(20):
        result = qtool.compare(sample("mlp"), copy, eval_dir("mlp"), options=EvaluationOptions(limit=1), gates=gates)
        assert result.primary_latency is not None and result.primary_latency.latency_ratio_interval is not None
        passed += result.gates_passed
    assert passed >= 19


def test_a_failed_latency_gate_is_timed_again_on_fresh_sessions(tmp_path, monkeypatch):
    # The first pair of sessions reads 10 % slow (as sessions can for their whole life); the fresh pair
    # measures the byte copy as it is, so the gate passes and says why. A slow candidate fails both.
    import qtool.evaluation.latency as latency
    from qtool.evaluation.gates import parse_gates

    copy = tmp_path / "copy.onnx"
    copy.write_bytes(sample("mlp").read_bytes())
    real, calls = latency.paired_ratio, []

    def first_pair_slow(reference, candidate):
        calls.append(1)
        return (1.10, (1.08, 1.12)) if len(calls) == 1 else real(reference, candidate)

    monkeypatch.setattr(latency, "paired_ratio", first_pair_slow)
    options = EvaluationOptions(limit=1, runs=30)
    result = qtool.compare(
        sample("mlp"), copy, eval_dir("mlp"), options=options, gates=parse_gates(max_latency_ratio=1.0)
    )
    (gate,) = result.gates
    assert len(calls) == 2 and result.primary_latency is not None and result.primary_latency.latency_ratio == 1.10
    assert gate.passed and "fresh sessions" in gate.note and "was not the models'" in gate.note
    monkeypatch.setattr(latency, "paired_ratio", real)
    slow = qtool.compare(
        sample("mlp"), copy, eval_dir("mlp"), options=options, gates=parse_gates(max_latency_ratio=0.01)
    )
    assert not slow.gates[0].passed and "fails again" in slow.gates[0].note


def test_quantize_says_when_it_scores_the_calibration_samples(tmp_path):
    base = ["quantize", sample("mlp"), "--data", calib_dir("mlp"), "--runs", "0", "--no-search"]
    same = invoke(*base, "-o", tmp_path / "a.onnx", "--json", tmp_path / "a.json")
    assert same.exit_code == 0, same.stderr
    assert "calibrated on" in same.stderr and "scored on the calibration samples" in same.stdout
    doc = json.loads((tmp_path / "a.json").read_text())["comparison"]
    assert doc["data"]["calibration_data"] is True and doc["data"]["dir"] == str(calib_dir("mlp"))
    held = invoke(*base, "--eval", eval_dir("mlp"), "-o", tmp_path / "b.onnx", "--json", tmp_path / "b.json")
    assert held.exit_code == 0, held.stderr
    assert "calibrated on" not in held.stderr and "scored on the calibration samples" not in held.stdout
    doc = json.loads((tmp_path / "b.json").read_text())["comparison"]
    assert doc["data"] == {"dir": str(eval_dir("mlp")), "samples": 32, "calibration_data": False}
    assert f"32 samples of {eval_dir('mlp')}" in held.stdout.replace("\n", "")


def test_quantize_with_stats_compares_on_eval(tmp_path):
    stats = tmp_path / "s.json"
    assert invoke("calibrate", sample("mlp"), calib_dir("mlp"), "-o", stats).exit_code == 0
    r = invoke("quantize", sample("mlp"), "--stats", stats, "--eval", eval_dir("mlp"), "-o", tmp_path / "q.onnx")
    assert r.exit_code == 0, r.stderr
    assert "accuracy vs reference, 32 samples" in r.stdout
    report = to_markdown(qtool.compare(sample("mlp"), tmp_path / "q.onnx", eval_dir("mlp")))
    assert "Scored on the calibration samples" not in report


def test_baseline_shows_the_change_and_gates_regressions(cnn_int8, tmp_path):
    base = ["compare", sample("cnn"), "--data", eval_dir("cnn"), "--runs", "20", "--warmup", "2"]
    assert invoke(*base[:2], cnn_int8, *base[2:], "--json", tmp_path / "main.json").exit_code == 0
    same = invoke(
        *base[:2],
        cnn_int8,
        *base[2:],
        "--baseline",
        tmp_path / "main.json",
        "--fail-on-regression",
        "--json",
        tmp_path / "same.json",
        "--markdown",
        tmp_path / "same.md",
    )
    assert same.exit_code == 0, same.stderr
    doc = json.loads((tmp_path / "same.json").read_text())["baseline"]
    assert doc["regressed"] is False and doc["same_reference"] and doc["same_data"]
    sqnr = next(c for c in doc["changes"] if c["metric"] == "sqnr")
    assert sqnr["change"] == pytest.approx(0.0, abs=1e-9)  # same models, same data: the same accuracy
    assert {c["metric"] for c in doc["changes"]} >= {"compression", "sqnr", "latency_ratio"}
    assert "### Against the baseline" in (tmp_path / "same.md").read_text()
    # a worse candidate: int4 weights lose accuracy against the int8 baseline
    worse = tmp_path / "int4.onnx"
    config = tmp_path / "int4.yaml"
    config.write_text("global: {weight: {dtype: int4, granularity: per_channel}}\n")
    qtool.quantize(sample("cnn"), worse, config_path=config, data_dir=calib_dir("cnn"), evaluation=None)
    bad = invoke(
        *base[:2],
        worse,
        *base[2:],
        "--baseline",
        tmp_path / "main.json",
        "--fail-on-regression",
        "--json",
        tmp_path / "bad.json",
        "--junit",
        tmp_path / "bad.xml",
    )
    assert bad.exit_code == 1, bad.stderr
    assert "sqnr vs baseline" in bad.stderr and "regressed" in bad.stdout
    doc = json.loads((tmp_path / "bad.json").read_text())
    assert doc["baseline"]["regressed"] is True
    failed = [g["metric"] for g in doc["gates"]["results"] if not g["passed"]]
    assert "sqnr vs baseline" in failed
    assert "sqnr vs baseline" in (tmp_path / "bad.xml").read_text()


def test_a_bad_baseline_is_refused_before_any_work(tmp_path):
    (tmp_path / "not.json").write_text('{"format": "qtool-calibration-stats"}')
    base = ["compare", sample("mlp"), sample("mlp"), "--data", eval_dir("mlp"), "--json", tmp_path / "r.json"]
    r = invoke(*base, "--baseline", tmp_path / "not.json")
    assert r.exit_code == 2 and "is not a 'qtool compare --json' report" in r.stderr
    r = invoke(*base, "--fail-on-regression")
    assert r.exit_code == 2 and "--fail-on-regression needs --baseline" in r.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(("stated", "allowed"), [(None, 1.02), ("0", 1.0), ("0%", 1.0), ("5%", 1.05), ("0.1", 1.1)])
def test_latency_gates_allow_the_stated_tolerance_or_two_percent(stated, allowed):
    from qtool.evaluation.gates import evaluate_gates, parse_gates

    (gate,) = parse_gates(max_latency_ratio=1.0, latency_tolerance=stated)
    assert gate.allowed == pytest.approx(allowed)
    inside, outside = (allowed - 0.001, allowed + 0.05), (allowed + 0.001, allowed + 0.05)
    judged = evaluate_gates([gate], {"latency_ratio": allowed}, {"latency_ratio": inside})
    assert judged[0].passed
    judged = evaluate_gates([gate], {"latency_ratio": allowed}, {"latency_ratio": outside})
    assert not judged[0].passed
