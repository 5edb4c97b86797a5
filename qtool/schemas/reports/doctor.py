"""``qtool doctor``: what this machine offers qtool, as the pydantic model that is both its record and its JSON."""

from __future__ import annotations

from pydantic import Field

from qtool.schemas.reports.base import _Report


class DoctorProvider(_Report):
    """One onnxruntime execution provider and whether a session on it loads."""

    name: str
    loads: bool
    detail: str


class DoctorReport(_Report):
    """``qtool doctor --json``: versions, CPU, execution providers, the QDQ kernels' opsets and GPUs."""

    schema_version: int = 1
    versions: dict[str, str]
    system: str
    cpu: dict[str, object]
    int8_kernels_saturate: bool
    providers: list[DoctorProvider]
    qdq_kernel_opsets: dict[str, int | None]
    gpus: list[str] = Field(default_factory=list)
