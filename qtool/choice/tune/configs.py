"""Allocations as QConfigDicts: every tuned node named with its option, everything else float."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from qtool.choice.tune.space import OPTIONS, Option
from qtool.schemas.config import FP8_DTYPES


def allocation_document(
    base: Mapping[str, Any], op_types: Iterable[str], allocation: Mapping[str, Option | str]
) -> dict[str, Any]:
    """The config document for ``allocation`` (node -> option) over the ``base`` document.

    Every op type qtool would quantize is set to null (float) and each allocated node gets its
    option as a ``node_name`` rule, which wins over ``op_type``. The accuracy search is off, so
    ``qtool quantize --config`` builds exactly this allocation.
    """
    document = copy.deepcopy(dict(base))
    document["op_type"] = {op: None for op in sorted(set(op_types))}
    rules = {}
    for node in sorted(allocation):
        option = allocation[node]
        entry = (OPTIONS[option] if isinstance(option, str) else option).entry
        if entry is not None:
            rules[node] = copy.deepcopy(entry)
    document["node_name"] = rules
    document["exclude"] = []
    document["accuracy"] = {**dict(document.get("accuracy") or {}), "target_sqnr_db": None}
    _fp8_written_symmetric(document)
    return document


def _fp8_written_symmetric(document: dict[str, Any]) -> None:
    """Write ``symmetric: true`` where ``global`` is fp8 over the built-in default's ``false`` (the same model).

    fp8 is symmetric whatever the default says, but a config *file* that says ``false`` beside fp8 is refused
    when read: the config written must read back. Rules that give the role another dtype keep ``false``.
    """
    base = document.get("global")
    for role in ("weight", "activation"):
        section = base.get(role) if isinstance(base, dict) else None
        if (
            not isinstance(section, dict)
            or section.get("dtype") not in FP8_DTYPES
            or section.get("symmetric") is not False
        ):
            continue
        section["symmetric"] = True
        for rules in (document.get("op_type"), document.get("node_name")):
            for entry in (rules or {}).values():
                own = entry.get(role) if isinstance(entry, dict) else None
                if isinstance(own, dict) and own.get("dtype") not in (None, *FP8_DTYPES):
                    own.setdefault("symmetric", False)


def config_text(document: Mapping[str, Any], header: str) -> str:
    """The YAML text written with ``--config-out``: a comment header, then the document."""
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return lines + yaml.safe_dump(dict(document), sort_keys=False, default_flow_style=False)
