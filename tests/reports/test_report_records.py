"""Report records built directly as their schema models: what JSON cannot hold is written as null."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from qtool.choice.tune.loop import MarginChoice
from qtool.choice.tune.sensitivity import Sensitivity
from qtool.choice.validated import Validation, ValidationRound
from qtool.graph.model_files import ModelFile
from qtool.schemas import reports as doc
from qtool.schemas import tune


def test_a_non_finite_figure_is_held_as_measured_and_written_as_null():
    step = doc.PlacementValidationReport(
        candidate="auto", samples=["a.npy", "b.npy"], sqnr_db=math.inf, bound_db=-math.inf, meets_target=False
    )
    assert step.sqnr_db == math.inf  # the record keeps the figure
    assert step.model_dump()["sqnr_db"] is None and step.model_dump()["bound_db"] is None


def test_a_validation_is_read_by_field_name_and_its_own_fields_are_left_out():
    validation = Validation(["a.npy"], math.inf, 31.5, meets=True, closed_loop=True)
    assert tune.TuneValidation.model_validate(validation, from_attributes=True).model_dump() == {
        "samples": ["a.npy"],
        "sqnr_db": None,  # infinite SQNR (an exact match): null
        "bound_db": 31.5,
        "metric": None,
        "metric_bound": None,
        "meets": True,
    }


def test_tune_records_are_read_under_the_report_names_sorted_by_node_and_finite():
    sensitivity = Sensitivity({"b": {"int8": math.inf, "int4": 0.25}, "a": {"int8": 0.5}}, {"b": ["int8"], "a": []})
    sensitivity.nodes, sensitivity.samples = 2, ["s.npy"]
    read = tune.TuneSensitivity.model_validate(sensitivity, from_attributes=True).model_dump()
    assert read["nodes"] == 2 and read["samples"] == ["s.npy"]
    assert list(read["noise_to_signal"]) == ["a", "b"] and list(read["measured"]) == ["a", "b"]
    assert read["noise_to_signal"]["b"] == {"int8": None, "int4": 0.25}  # a failing option: null, not Infinity
    validation = Validation(["v.npy"], 33.0, 31.0, meets=True)
    round_ = tune.TuneRound.model_validate(ValidationRound(MarginChoice(3, 0.5), validation), from_attributes=True)
    assert (round_.trial, round_.margin, round_.validation.bound_db) == (3, 0.5, 31.0)
    written = tune.TunedFile.model_validate(ModelFile("m.onnx", 1234, "ab" * 32), from_attributes=True)
    assert written.model_dump() == {"path": "m.onnx", "sha256": "ab" * 32, "bytes": 1234}


def test_an_inspected_node_is_a_frozen_record():
    node = doc.InspectedNode(
        name="conv",
        op_type="Conv",
        rule="default",
        weight="int8 per_channel sym",
        activation="uint8 per_tensor asym",
        weight_elements=8,
        float_bytes=32,
        quantized_bytes=12,
        placement="integer",
        placement_reason="",
        predicted_kernel="QLinearConv",
        integer_kernel=True,
        kernel_reason="",
        algorithms=[],
        weight_form="int8",
    )
    with pytest.raises(ValidationError):
        node.name = "other"  # type: ignore[misc]
