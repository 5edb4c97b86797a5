"""Report models filled from the records the library returns: each field read by its name, none copied by hand.

The schema models (:mod:`qtool.schemas.reports`) are the one definition of every JSON document. A report
field that a library record holds under the same name is read from it; only the fields a report names
otherwise, or computes, are given.
"""

from __future__ import annotations

import math
import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel

from qtool._version import __version__

M = TypeVar("M", bound=BaseModel)


def document(model: type[M], source: object, schema_version: int, /, **given: Any) -> M:
    """A command's JSON document: :func:`filled`, headed by its schema's version and qtool's."""
    return filled(model, source, schema_version=schema_version, qtool_version=__version__, **given)


def file_record(model: type[M], file: Any, /, **given: Any) -> M:
    """A model file's record (path, sha256, ...): :func:`filled`, its ``bytes`` from the file's size."""
    return filled(model, file, bytes=file.size_bytes, **given)


def filled(model: type[M], source: object, /, **given: Any) -> M:
    """``model`` with each field read from ``source``'s attribute of the same name, ``given`` over them.

    ``given``: the fields ``source`` names otherwise or that are computed. A tuple becomes a list, and a number
    that is not finite becomes null where the field allows it (JSON has neither NaN nor Infinity).
    """
    fields = model.model_fields
    values = {name: getattr(source, name) for name in fields if name not in given and hasattr(source, name)}
    values.update(given)
    return model.model_validate(
        {name: _json(value, _nullable(fields[name].annotation)) for name, value in values.items()}
    )


def _nullable(annotation: Any) -> bool:
    """Whether a field's type admits None (``X | None`` or ``Optional[X]``)."""
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def _json(value: Any, nullable: bool) -> Any:
    if isinstance(value, float) and not math.isfinite(value) and nullable:
        return None
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):  # a dict of numbers (output -> dB): each non-finite one null
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in value.items()}
    return value
