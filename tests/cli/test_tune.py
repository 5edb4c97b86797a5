"""qtool tune: the smallest model meeting a budget, reproduced through --config-out."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.options import EvaluationOptions
from tests.conftest import calib_dir, eval_dir, sample

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def tune_args(name, tmp_path, *extra):
    return [
        "tune",
        sample(name),
        "--data",
        calib_dir(name),
        "--eval",
        eval_dir(name),
        "-o",
        tmp_path / "out.onnx",
        "--config-out",
        tmp_path / "chosen.yaml",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_tune_meets_the_target_smaller_than_int8_and_the_config_reproduces_it(name, tmp_path):
    r = invoke(*tune_args(name, tmp_path, "--target-sqnr", "30", "--json", tmp_path / "t.json"))
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    chosen = next(t for t in doc["trials"] if t["chosen"])
    assert doc["met"] and chosen["meets"] and chosen["bound_db"] >= 30 and chosen["pareto"]
    # the promise: the written model's bound on the validation half, which chose nothing
    validation = doc["validation"]
    assert validation["meets"] and validation["bound_db"] >= 30 and doc["promise_db"] == 30
    assert doc["promise"].startswith("SQNR >= 30 dB") and f"bound {validation['bound_db']:.2f} dB" in doc["promise"]
    samples = doc["samples"]
    assert not set(samples["selection"]) & set(samples["validation"])
    assert sorted(samples["selection"] + samples["validation"]) == sorted(p.name for p in eval_dir(name).iterdir())
    assert set(samples["sensitivity"]) <= set(samples["selection"]) and validation["samples"] == samples["validation"]
    assert samples["decode_steps"] is False  # not a decoder: each file scored once
    # what was written measures what its candidate measured (GPTQ codes do not depend on the other nodes)
    assert doc["written"]["sqnr_db"] == pytest.approx(chosen["sqnr_db"], abs=1e-6)
    assert doc["written"]["size_bytes"] == pytest.approx(chosen["size_bytes"], rel=0.01)
    # int4 where tolerable: smaller than int8 weights alone would make it
    assert (
        chosen["compression_ratio"] >= 3.5
        and chosen["precisions"].get("w4", 0) + chosen["precisions"].get("w4g", 0) >= 1
    )
    # the written model is the chosen one: an independent comparison on the validation samples agrees
    validation_dir = tmp_path / "validation"
    validation_dir.mkdir()
    for file in samples["validation"]:
        (validation_dir / file).symlink_to(eval_dir(name) / file)
    result = qtool.compare(sample(name), tmp_path / "out.onnx", validation_dir, options=EvaluationOptions(runs=0))
    assert result.overall.sqnr_db == pytest.approx(validation["sqnr_db"], abs=1e-4)  # sums in another order
    assert result.compression_ratio >= 3.5
    # the config reproduces it byte for byte through quantize
    chosen_yaml = yaml.safe_load((tmp_path / "chosen.yaml").read_text())
    assert chosen_yaml["accuracy"]["target_sqnr_db"] is None and chosen_yaml["node_name"]
    again = tmp_path / "again.onnx"
    q = invoke("quantize", sample(name), "--config", tmp_path / "chosen.yaml", "--data", calib_dir(name), "-o", again)
    assert q.exit_code == 0, q.stderr
    assert again.read_bytes() == (tmp_path / "out.onnx").read_bytes()


def test_the_time_budget_stops_the_search_with_the_best_so_far(tmp_path):
    r = invoke(*tune_args("transformer", tmp_path, "--target-sqnr", "30", "--time-budget", "0.05", "--json", "-"))
    assert r.exit_code in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    assert doc["out_of_time"] and not doc["sensitivity"]["complete"] and len(doc["trials"]) == 1
    assert "time budget" in r.stderr and (tmp_path / "out.onnx").exists() == (r.exit_code in (0, 1))
    assert any("cut the sensitivity measurement short" in note for note in doc["notes"])


METRIC = '''
import numpy as np

calls = []


def agreement(reference, candidate):
    """1 when the candidate's top class is the float model's."""
    return float(np.argmax(reference["logits"]) == np.argmax(candidate["logits"]))


def worst_error(reference, candidate):
    return float(np.abs(reference["logits"] - candidate["logits"]).max())


def labelled(reference, candidate, label):
    calls.append(int(label))
    return float(np.argmax(candidate["logits"]) == int(label))
'''


@pytest.mark.slow
def test_a_user_metric_is_the_budget(tmp_path, monkeypatch):
    (tmp_path / "mytask.py").write_text(METRIC)
    monkeypatch.chdir(tmp_path)
    r = invoke(*tune_args("mlp", tmp_path, "--metric", "mytask:agreement", "--target-metric", "1.0", "--json", "-"))
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    chosen = next(t for t in doc["trials"] if t["chosen"])
    assert doc["goal"] == "mytask:agreement >= 1" and chosen["metric"] == 1.0
    assert all((t["metric"] >= 1.0) == t["meets"] for t in doc["trials"])
    # an error metric: lower is better
    r = invoke(
        *tune_args("mlp", tmp_path, "--metric", "mytask:worst_error", "--target-metric", "0.5", "--lower-is-better")
    )
    assert r.exit_code == 0, r.stderr
    assert "mytask:worst_error <= 0.5" in r.stdout


def test_labels_reach_the_metric(tmp_path, monkeypatch):
    (tmp_path / "labelled_task.py").write_text(METRIC)
    monkeypatch.chdir(tmp_path)
    files = sorted(eval_dir("mlp").iterdir())
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(str(i % 10) for i in range(len(files))))
    args = tune_args("mlp", tmp_path, "--metric", "labelled_task:labelled", "--target-metric", "0.0", "--json", "-")
    r = invoke(*args, "--labels", labels)
    assert r.exit_code == 0, r.stderr
    import labelled_task

    # the selection half first, each sample with its own label (by its place in EVAL's sorted files)
    samples = json.loads(r.stdout)["samples"]
    position = {path.name: i for i, path in enumerate(files)}
    assert labelled_task.calls[: len(samples["selection"])] == [position[f] % 10 for f in samples["selection"]]
    assert labelled_task.calls[-len(samples["validation"]) :] == [position[f] % 10 for f in samples["validation"]]
    short = tmp_path / "short.txt"
    short.write_text("1\n2\n")
    r = invoke(*args, "--labels", short)
    assert r.exit_code == 2 and f"holds 2 labels for {len(files)} evaluation samples" in r.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "give exactly one of --target-sqnr DB, --metric module:function and --target-decode"),
        (["--target-sqnr", "30", "--metric", "m:f", "--target-metric", "1"], "give exactly one of"),
        (["--target-sqnr", "30", "--target-decode", "0.9"], "give exactly one of"),
        (["--target-decode", "90"], "--target-decode 90 is a share of generated tokens"),
        (["--target-decode", "0.9", "--decode-steps", "0"], "--decode-steps must be between 1 and 4096"),
        (["--target-decode", "0.9", "--lower-is-better"], "--lower-is-better without --metric"),
        (["--target-decode", "0.9"], "--target-decode needs a decoder"),
        (["--metric", "nosuchmodule_qtool:f", "--target-metric", "1"], "--metric: cannot import nosuchmodule_qtool"),
        (["--metric", "json:no_such_function", "--target-metric", "1"], "json has no function 'no_such_function'"),
        (["--metric", "json:dumps"], "--metric needs --target-metric"),
        (["--target-sqnr", "30", "--objective", "speed"], "--objective must be size or latency"),
        (["--target-sqnr", "30", "--time-budget", "0"], "--time-budget must be a number of seconds above 0"),
    ],
)
def test_bad_goals_are_refused_before_any_work(tmp_path, extra, message):
    r = invoke(*tune_args("mlp", tmp_path, *extra))
    assert r.exit_code == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "chosen.yaml").exists()


def test_config_out_must_be_yaml_and_nothing_is_written(tmp_path):
    args = tune_args("mlp", tmp_path, "--target-sqnr", "30")
    args[args.index("--config-out") + 1] = tmp_path / "chosen.txt"
    r = invoke(*args)
    assert r.exit_code == 2 and "must end in .yaml" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_latency_objective_times_every_candidate_and_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "tune.png"
    r = invoke(
        *tune_args("cnn", tmp_path, "--target-sqnr", "30", "--objective", "latency", "--max-latency-ratio", "1.5"),
        "--plot",
        png,
        "--json",
        tmp_path / "t.json",
    )
    assert r.exit_code in (0, 1), r.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert all(t["latency_ratio"] is not None and t["latency_ratio_interval"] for t in doc["trials"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every trial's SQNR is finite, but an all-float one's: exact, infinite, null in JSON (a trial the latency
    # objective reaches when the timing is noisy, as on a loaded machine)
    quantized = [t for t in doc["trials"] if set(t["allocation"].values()) != {"float"}]
    assert quantized and np.isfinite([t["sqnr_db"] for t in quantized]).all()
    assert all(t["sqnr_db"] is None for t in doc["trials"] if t not in quantized)


def test_tensorrt_target_chooses_only_integer_nodes_or_float(tmp_path):
    r = invoke(*tune_args("cnn", tmp_path, "--target-sqnr", "25", "--target", "tensorrt", "--json", "-"))
    assert r.exit_code in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    used = {option for t in doc["trials"] for option in t["allocation"].values()}
    assert used <= {"w8a8", "float"} and "w8a8" in used
    chosen = yaml.safe_load((tmp_path / "chosen.yaml").read_text())
    assert chosen["target"] == "tensorrt"


@pytest.mark.slow
def test_a_second_run_reuses_the_sensitivity_and_chooses_the_same_model(tmp_path, _own_tune_cache):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    r = invoke(*tune_args("mlp", first, "--target-sqnr", "30", "--json", first / "t.json"))
    assert r.exit_code == 0, r.stderr
    measured = json.loads((first / "t.json").read_text())["sensitivity"]
    # size alone: nothing is measured that only adds activation noise to w8's bytes
    assert not {"w8a8"} & {o for options in measured["measured"].values() for o in options}
    kept = list(_own_tune_cache.rglob("sensitivity-*.json"))
    assert not measured["cached"] and [str(p) for p in kept] == [measured["cache_file"]]
    r = invoke(*tune_args("mlp", second, "--target-sqnr", "30", "--json", second / "t.json"))
    assert r.exit_code == 0, r.stderr
    reused = json.loads((second / "t.json").read_text())["sensitivity"]
    assert reused["cached"] and reused["cache_file"] == measured["cache_file"] and "tune cache" in r.stdout + r.stderr
    assert reused["noise_to_signal"] == measured["noise_to_signal"] and reused["builds"] == measured["builds"]
    assert (second / "out.onnx").read_bytes() == (first / "out.onnx").read_bytes()
    assert (second / "chosen.yaml").read_text() == (first / "chosen.yaml").read_text()


@pytest.mark.slow
def test_other_data_or_no_cache_measure_again_and_a_damaged_file_is_ignored(tmp_path, _own_tune_cache):
    r = invoke(*tune_args("mlp", tmp_path, "--target-sqnr", "30", "--time-budget", "120"))
    assert r.exit_code == 0, r.stderr
    (kept,) = _own_tune_cache.rglob("sensitivity-*.json")
    # one calibration sample changed: another key, measured again and kept beside the first
    data = tmp_path / "calib"
    data.mkdir()
    for path in sorted(calib_dir("mlp").iterdir()):
        (data / path.name).write_bytes(path.read_bytes())
    first = sorted(data.glob("*.npy"))[0]
    np.save(first, np.load(first) * 1.01)
    args = tune_args("mlp", tmp_path, "--target-sqnr", "30", "--json", tmp_path / "t.json")
    args[args.index(calib_dir("mlp"))] = data
    assert invoke(*args).exit_code == 0
    assert not json.loads((tmp_path / "t.json").read_text())["sensitivity"]["cached"]
    assert len(list(_own_tune_cache.rglob("sensitivity-*.json"))) == 2
    # a damaged file is measured again (and replaced); --no-cache neither reads nor writes
    kept.write_text("{not json")
    r = invoke(*tune_args("mlp", tmp_path, "--target-sqnr", "30", "--json", tmp_path / "t.json"))
    assert r.exit_code == 0, r.stderr
    assert not json.loads((tmp_path / "t.json").read_text())["sensitivity"]["cached"]
    assert json.loads(kept.read_text())["format"] == 1
    before = {p: p.stat().st_mtime_ns for p in _own_tune_cache.rglob("*")}
    r = invoke(*tune_args("mlp", tmp_path, "--target-sqnr", "30", "--no-cache", "--json", tmp_path / "t.json"))
    assert r.exit_code == 0, r.stderr
    unused = json.loads((tmp_path / "t.json").read_text())["sensitivity"]
    assert not unused["cached"] and unused["cache_file"] is None  # the kept measurement was there to read
    assert {p: p.stat().st_mtime_ns for p in _own_tune_cache.rglob("*")} == before
    private = tmp_path / "private-cache"
    r = invoke(*tune_args("mlp", tmp_path, "--target-sqnr", "30", "--no-cache", "--cache-dir", private))
    assert r.exit_code == 0, r.stderr
    assert not private.exists()


@pytest.mark.slow
def test_nodes_are_measured_on_eval_samples_and_their_bytes_key_the_cache(tmp_path, _own_tune_cache):
    first = tmp_path / "first"
    first.mkdir()
    r = invoke(*tune_args("mlp", first, "--target-sqnr", "30", "--json", first / "t.json"))
    assert r.exit_code == 0, r.stderr
    measured = json.loads((first / "t.json").read_text())["sensitivity"]
    held_out = sorted(p.name for p in eval_dir("mlp").glob("*.npy"))
    # eight samples (the default) of the selection half, spread over it: the middle one of each eighth
    selection = json.loads((first / "t.json").read_text())["samples"]["selection"]
    assert measured["samples"] == [selection[(2 * i + 1) * len(selection) // 16] for i in range(8)]
    # one of those samples changed (same CALIB): measured anew, and the numbers follow the new sample (the
    # halves are matched on the float outputs' energy, so they may regroup around the louder sample)
    data = tmp_path / "eval"
    data.mkdir()
    for name in held_out:
        (data / name).write_bytes((eval_dir("mlp") / name).read_bytes())
    changed = data / measured["samples"][0]
    np.save(changed, np.load(changed) * 4.0)
    second = tmp_path / "second"
    second.mkdir()
    args = tune_args("mlp", second, "--target-sqnr", "30", "--json", second / "t.json")
    args[args.index(eval_dir("mlp"))] = data
    r = invoke(*args)
    assert r.exit_code == 0, r.stderr
    again = json.loads((second / "t.json").read_text())["sensitivity"]
    assert not again["cached"] and again["noise_to_signal"] != measured["noise_to_signal"]
    assert len(list(_own_tune_cache.rglob("sensitivity-*.json"))) == 2


def test_an_unreachable_target_ends_with_exit_1_and_the_best_reachable_figure(tmp_path):
    r = invoke(*tune_args("mlp", tmp_path, "--target-sqnr", "150", "--json", tmp_path / "t.json"))
    assert r.exit_code == 1, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "no quantized model reaches SQNR >= 150 dB" in error[0], r.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert not doc["met"] and not doc["reachable"] and doc["promise"] is None
    # what it names is what was written: quantized (not the float model), the most accurate tried
    written = doc["written"]
    assert any(option != "float" for option in written["allocation"].values())
    assert f"{written['compression_ratio']:.2f}x smaller" in error[0]
    assert f"up to {doc['validation']['bound_db']:.1f} dB is reachable" in error[0]
    # every float-only candidate is marked as such, never as meeting the target
    floats = [t for t in doc["trials"] if set(t["allocation"].values()) == {"float"}]
    assert all(not t["meets"] and t["note"] == "nothing quantized" for t in floats)


def test_confidence_must_be_a_probability(tmp_path):
    r = invoke(*tune_args("mlp", tmp_path, "--target-sqnr", "30", "--confidence", "1.5"))
    assert r.exit_code == 2 and "--confidence 1.5 must be at least 0.5 and below 1" in r.stderr
    assert not list(tmp_path.iterdir())


def test_an_eval_folder_of_one_sample_cannot_be_split(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    first = sorted(eval_dir("mlp").iterdir())[0]
    (one / first.name).symlink_to(first)
    args = tune_args("mlp", tmp_path, "--target-sqnr", "30")
    args[args.index(eval_dir("mlp"))] = one
    r = invoke(*args)
    assert r.exit_code == 2 and "holds 1 sample: tune selects on half of EVAL" in r.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_a_log_gets_plain_progress_lines_for_every_phase(tmp_path):
    import os
    import subprocess
    import sys

    args = [str(a) for a in tune_args("transformer", tmp_path, "--target-sqnr", "30", "--no-cache")]
    env = {**os.environ, "QTOOL_PROGRESS_SECONDS": "0"}  # every step (a log's default is a line per 10 s)
    done = subprocess.run([sys.executable, "-m", "qtool", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("progress: ")]
    phases = {line.split()[1] for line in lines}
    assert {"calibrating", "sensitivity", "candidates"} <= phases, done.stderr
    assert any(line.startswith("progress: candidates") and " done (" in line for line in lines)
    assert "\x1b[" not in done.stderr and "━" not in done.stderr  # plain text: no bars, no colours


@pytest.mark.slow
def test_the_time_budget_covers_the_final_build(tmp_path):
    budget = 6.0
    args = tune_args("encoder", tmp_path, "--target-sqnr", "30", "--time-budget", str(budget), "--no-cache")
    r = invoke(*args, "--json", tmp_path / "t.json")
    assert r.exit_code in (0, 1), r.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    # the search stopped early enough for the written model to be built and scored within the budget
    assert doc["seconds"] <= budget * 1.15 and (tmp_path / "out.onnx").exists()
