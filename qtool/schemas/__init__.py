"""One definition per file format qtool reads or writes, as pydantic models.

The models validate what qtool reads (configs, statistics) and shape what it writes (JSON reports),
and ``qtool schema NAME`` prints their JSON Schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from qtool.errors import QtoolError


def _models() -> dict[str, type[BaseModel]]:
    from qtool.schemas.config import ConfigDocument
    from qtool.schemas.reports import CalibrateReport, CompareReport, DoctorReport, InspectReport, QuantizeReport
    from qtool.schemas.stats import StatsFile
    from qtool.schemas.tune import TuneReport

    return {
        "config": ConfigDocument,
        "stats": StatsFile,
        "calibrate-report": CalibrateReport,
        "quantize-report": QuantizeReport,
        "compare-report": CompareReport,
        "inspect-report": InspectReport,
        "tune-report": TuneReport,
        "doctor-report": DoctorReport,
    }


SCHEMA_NAMES = (
    "config",
    "stats",
    "calibrate-report",
    "quantize-report",
    "compare-report",
    "inspect-report",
    "tune-report",
    "doctor-report",
)


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one of :data:`SCHEMA_NAMES`.

    Raises:
        QtoolError: an unknown name.
    """
    models = _models()
    if name not in models:
        raise QtoolError(f"unknown schema '{name}'", hint=f"choose one of: {', '.join(SCHEMA_NAMES)}")
    schema = models[name].model_json_schema(by_alias=True)
    if name == "config":
        from qtool.schemas.config import schema_with_defaults

        schema = schema_with_defaults(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"qtool:{name}", **schema}
