"""``qtool calibrate --json``: the summary of a calibration, as a pydantic model."""

from __future__ import annotations

from qtool.schemas.reports.base import _Report


class CalibrateReport(_Report):
    """``qtool calibrate --json``: a summary of the statistics written."""

    schema_version: int
    qtool_version: str
    stats_path: str
    observer: str
    samples: int
    tensors: int
    model_sha256: str
