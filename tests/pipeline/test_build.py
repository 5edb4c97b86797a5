"""The builder: config -> plan -> model over one workspace; a kept build is handed out again, not rewritten."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from qtool.config import load_config
from qtool.options import DEFAULT_CALIBRATION
from qtool.pipeline.build import Builder, input_collector, weight_algorithms
from qtool.pipeline.calibrate import observe
from qtool.pipeline.workspace import open_workspace
from tests.conftest import calib_dir, run_model, sample


def _builder(name: str, config=None) -> Builder:
    ws = open_workspace(sample(name), load_config(config))
    return Builder(ws, observe(ws, calib_dir(name), DEFAULT_CALIBRATION))


def test_a_kept_build_is_handed_out_once_and_equals_a_fresh_one():
    builder = _builder("cnn")
    integer = replace(builder.ws.config, auto_placement="integer")
    kept = builder.build(integer, keep=True)
    again = builder.build(integer)
    assert again is kept  # the placement choice's candidate is the model written
    fresh = builder.build(integer)
    assert fresh is not kept
    weights = builder.ws.weights
    assert weights.embedded(fresh.model).SerializeToString() == weights.embedded(kept.model).SerializeToString()


def test_the_built_model_runs_close_to_float_and_follows_its_plan():
    builder = _builder("cnn", {"global": {"placement": "integer"}})
    built = builder.build(builder.ws.config)
    assert {n.placement for n in built.plan.nodes} == {"integer"}
    x = np.load(sorted(calib_dir("cnn").iterdir())[0])[None]
    reference = run_model(sample("cnn").read_bytes(), {"input": x})[0]
    quantized = run_model(builder.ws.weights.embedded(built.model).SerializeToString(), {"input": x})[0]
    assert np.corrcoef(reference.ravel(), quantized.ravel())[0, 1] > 0.99


def test_without_samples_the_weight_algorithms_are_skipped_with_a_note():
    ws = open_workspace(sample("cnn"), load_config({"global": {"algorithms": {"rounding": "gptq"}}}))
    collector = input_collector(ws)
    assert collector is not None  # every Conv and the Gemm ask for their inputs
    algorithms, note = weight_algorithms(ws, collector, False)
    assert algorithms is None and note is not None and "gptq need calibration samples" in note


def test_no_collector_without_an_algorithm_that_needs_inputs():
    ws = open_workspace(sample("cnn"), load_config())
    assert input_collector(ws) is None
