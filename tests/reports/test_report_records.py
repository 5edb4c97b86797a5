"""Report records built directly as their schema models: what JSON cannot hold is written as null."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from qtool.choice.validated import Validation
from qtool.reports.tuning import _validation
from qtool.schemas import reports as doc


def test_a_non_finite_figure_is_held_as_measured_and_written_as_null():
    step = doc.PlacementValidationReport(
        candidate="auto", samples=["a.npy", "b.npy"], sqnr_db=math.inf, bound_db=-math.inf, meets_target=False
    )
    assert step.sqnr_db == math.inf  # the record keeps the figure
    assert step.model_dump()["sqnr_db"] is None and step.model_dump()["bound_db"] is None


def test_a_validation_is_read_by_field_name_and_its_own_fields_are_left_out():
    validation = Validation(["a.npy"], math.inf, 31.5, meets=True, closed_loop=True)
    assert _validation(validation).model_dump() == {
        "samples": ["a.npy"],
        "sqnr_db": None,  # infinite SQNR (an exact match): null
        "bound_db": 31.5,
        "metric": None,
        "metric_bound": None,
        "meets": True,
    }


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
