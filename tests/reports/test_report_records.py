"""Report models filled from library records by field name (qtool.reports.records)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from qtool.reports.records import filled
from qtool.schemas import reports as doc


@dataclass
class _Measured:
    name: str
    mse: float
    sqnr_db: float
    cosine: float
    max_abs_error: float
    elements: int
    extra: str = "not a report field"


def test_fields_are_read_by_name_and_what_json_cannot_hold_is_null():
    exact = filled(doc.Metrics, _Measured("y", 0.0, math.inf, 1.0, 0.0, 4))
    assert exact.model_dump() == {
        "name": "y",
        "mse": 0.0,
        "sqnr_db": None,  # infinite SQNR: null where the field allows it
        "cosine": 1.0,
        "max_abs_error": 0.0,
        "elements": 4,
    }
    # a field given by the caller wins over the record's attribute; tuples become lists
    step = filled(
        doc.PlacementValidationReport,
        _Measured("y", 0.0, 1.0, 1.0, 0.0, 4),
        candidate="auto",
        samples=("a.npy", "b.npy"),
        bound_db=-math.inf,
        meets_target=False,
        sqnr_db=31.5,
    )
    assert step.samples == ["a.npy", "b.npy"] and step.bound_db is None and step.sqnr_db == 31.5


def test_a_field_the_record_lacks_and_nobody_gives_is_an_error():
    with pytest.raises(ValidationError):
        filled(doc.LargestDrop, _Measured("y", 0.0, 1.0, 1.0, 0.0, 4))
