"""Strings from models and files reach the terminal as text: records of every kind are copied with them escaped."""

from __future__ import annotations

import math

from qtool.reports.terminal import for_terminal
from qtool.schemas.reports.compare import Metrics


def test_a_report_record_is_copied_with_its_strings_escaped_and_its_numbers_as_they_are():
    hostile = "out[bold]put\x1b[31m"  # Rich markup and a terminal escape, as an ONNX output may be named
    record = Metrics(name=hostile, mse=0.5, sqnr_db=math.inf, cosine=1.0, max_abs_error=2.0, elements=4)
    shown = for_terminal({"rows": [record]})["rows"][0]
    assert isinstance(shown, Metrics) and shown is not record
    assert shown.name == "out\\[bold]put\\x1b[31m" and record.name == hostile  # the original untouched
    assert (shown.mse, shown.sqnr_db, shown.elements) == (0.5, math.inf, 4)
