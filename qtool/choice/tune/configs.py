"""Allocations as QConfigDicts: every tuned node named with its option, everything else float."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from qtool.choice.tune.space import OPTIONS, Option


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
    return document


def config_text(document: Mapping[str, Any], header: str) -> str:
    """The YAML text written with ``--config-out``: a comment header, then the document."""
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return lines + yaml.safe_dump(dict(document), sort_keys=False, default_flow_style=False)
