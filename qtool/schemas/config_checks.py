"""Checking a QConfigDict against its models: errors in qtool's words, at the YAML line of the key or value.

:func:`validate_document` validates a parsed document; an explicit ``null`` where none is
allowed is marked first so that the error points at it; :func:`located_error` turns pydantic's
first error into a QtoolError at the YAML position; rule names and patterns are checked too.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import onnx.defs
import re2
from pydantic import BaseModel, ValidationError

from qtool.errors import QtoolError
from qtool.located_yaml import LocatedYaml
from qtool.schemas.config import (
    ACTIVATION_DTYPES,
    CONFIG_VERSION,
    FP8_DTYPES,
    GRANULARITIES,
    MAX_BLOCK_SIZE,
    ROUNDINGS,
    SATURATION_GUARDS,
    WEIGHT_DTYPES,
    ConfigDocument,
)

_ONNX_OPS = sorted({schema.name for schema in onnx.defs.get_all_schemas()})


class _Null:
    """Stands in for an explicit ``null`` where none is allowed, so that validation reports it there."""

    def __repr__(self) -> str:
        return "None"


NULL = _Null()


def _mark_nulls(value: Any, model: type[BaseModel] | None) -> Any:
    """``value`` with every forbidden explicit null replaced by :data:`NULL`."""
    if model is None or not isinstance(value, dict):
        return value
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    nullable: frozenset[str] = getattr(model, "nullable", frozenset())
    marked: dict[str, Any] = {}
    for key, item in value.items():
        field = fields.get(key)
        if field is None:
            marked[key] = item
        elif item is None:
            marked[key] = None if key in nullable else NULL
        elif isinstance(item, dict) and key in ("op_type", "node_name"):
            rule = _model_of(field.annotation)
            marked[key] = {name: _mark_nulls(entry, rule) for name, entry in item.items()}
        else:
            marked[key] = _mark_nulls(item, _model_of(field.annotation))
    return marked


def validate_document(value: Any, error: Callable[..., QtoolError]) -> ConfigDocument:
    """Validate a parsed YAML document; ``error(path, message, hint=..., at_key=...)`` locates failures."""
    if not isinstance(value, dict):
        raise error((), f"expected a mapping, got {type(value).__name__}")
    if "global" in value and value["global"] is None:
        raise error(("global",), "global cannot be null", hint="use op_type or exclude to keep nodes in float")
    try:
        document = ConfigDocument.model_validate(_mark_nulls(value, ConfigDocument))
    except ValidationError as e:
        raise located_error(e, error) from None
    _check_names(value, error)
    _check_fp8(value, error)
    return document


def _check_names(value: dict[str, Any], error: Callable[..., QtoolError]) -> None:
    """Rule keys and exclude entries: valid RE2 patterns, and op types ONNX knows."""

    def check_pattern(pattern: str, path: tuple[str, ...], *, at_key: bool) -> None:
        if pattern.startswith("re:"):
            try:
                compiled_pattern(pattern[3:])
            except (ValueError, OverflowError, RecursionError) as e:
                raise error(
                    path,
                    f"invalid regular expression: {e}",
                    hint="patterns use RE2 syntax (Python's, without backreferences and lookaround)",
                    at_key=at_key,
                ) from e

    for section in ("op_type", "node_name"):
        for key in value.get(section) or {}:
            check_pattern(key, (section, key), at_key=True)
    for index, pattern in enumerate(value.get("exclude") or []):
        check_pattern(pattern, ("exclude", str(index)), at_key=False)
    for op_type in value.get("op_type") or {}:
        if not onnx.defs.has(op_type):
            close = difflib.get_close_matches(op_type, _ONNX_OPS, n=3)
            raise error(
                ("op_type", op_type),
                f"unknown ONNX op type '{op_type}'",
                hint=f"did you mean {', '.join(close)}?" if close else "op types are case-sensitive",
                at_key=True,
            )


# What fp8 weights and activations cannot be: (key, value) -> (what fp8 is, how to fix it).
_FP8_CONFLICTS = {
    ("symmetric", False): ("symmetric only (zero point 0)", "remove symmetric: false"),
    ("granularity", "per_block"): ("per_tensor or per_channel", "use granularity: per_channel"),
    ("format", "matmul_nbits"): ("stored as QDQ (MatMulNBits holds integers)", "use format: qdq"),
}


def _check_fp8(value: dict[str, Any], error: Callable[..., QtoolError]) -> None:
    """fp8 weights and activations: symmetric only, weights per_tensor or per_channel, stored as QDQ.

    A rule takes what it leaves out from ``global``, so a setting written under ``global`` can
    contradict the fp8 dtype of an ``op_type`` or ``node_name`` rule: the error points at the
    setting and names the rule. The built-in default's ``activation.symmetric: false`` is not the
    user's: fp8 activations are symmetric whatever it says.
    """
    given = value.get("global")
    base: dict[str, Any] = given if isinstance(given, dict) else {}
    rules: list[tuple[tuple[str, ...], dict[str, Any]]] = [(("global",), base)]
    for section in ("op_type", "node_name"):
        entries = value.get(section)
        if isinstance(entries, dict):
            rules += [((section, name), entry) for name, entry in entries.items() if isinstance(entry, dict)]
    for path, entry in rules:
        for role in ("weight", "activation"):
            dtype = _rule_setting(entry, base, path, role, "dtype")
            if dtype is None or dtype[1] not in FP8_DTYPES:
                continue
            for (key, bad), (fp8_is, fix) in _FP8_CONFLICTS.items():
                found = _rule_setting(entry, base, path, role, key)
                if found is not None and found[1] == bad:
                    rule = ":".join(path)
                    raise error(found[0], f"rule {rule} asks for {dtype[1]} {role}s, which are {fp8_is}", hint=fix)


def merged_fp8_conflict(layers: list[tuple[str, dict[str, Any]]]) -> tuple[str, str, str, Any, str, str] | None:
    """What a node's rules, laid over each other, ask that fp8 cannot be: one rule's fp8 meeting another's setting.

    ``layers``: (rule, its settings as written), from ``global`` to the most specific. Returns (the rule of the
    setting, role, key, value, the rule that gave fp8, what fp8 is), or None. The static check of each rule
    (above) cannot see these: which ``op_type`` rule a ``node_name`` rule is laid over depends on the node.
    """

    def last(role: str, key: str) -> tuple[str, Any] | None:
        for rule, values in reversed(layers):
            section = values.get(role)
            if isinstance(section, dict) and key in section:
                return rule, section[key]
        return None

    for role in ("weight", "activation"):
        dtype = last(role, "dtype")
        if dtype is None or dtype[1] not in FP8_DTYPES:
            continue
        for (key, bad), (fp8_is, _) in _FP8_CONFLICTS.items():
            found = last(role, key)
            if found is not None and found[1] == bad:
                return found[0], role, key, bad, dtype[0], fp8_is
    return None


def check_merged_rules(layers: list[tuple[str, dict[str, Any]]], located: LocatedYaml | None, node: str) -> None:
    """Refuse what a node's rules ask together and fp8 cannot be, at the YAML line of the setting the user wrote."""
    conflict = merged_fp8_conflict(layers)
    if conflict is None or located is None:
        return
    rule, role, key, value, fp8_rule, fp8_is = conflict
    path = (*rule.split(":", 1), role, key)
    if path not in located.marks:  # the built-in default's (activation.symmetric: false): fp8 ignores it
        return
    fix = next(fix for (k, _), (_, fix) in _FP8_CONFLICTS.items() if k == key)
    raise located.error(
        path,
        f"node '{node}' takes fp8 {role}s from rule {fp8_rule}, which are {fp8_is}; "
        f"rule {rule} asks for {key}: {value}",
        hint=f"{fix} in rule {rule}, or give it a {role} dtype of its own",
    )


def _rule_setting(
    entry: dict[str, Any], base: dict[str, Any], path: tuple[str, ...], role: str, key: str
) -> tuple[tuple[str, ...], Any] | None:
    """Where ``role.key`` of the rule at ``path`` is written and its value: the rule's own, else global's."""
    for where, settings in ((path, entry), (("global",), base)):
        section = settings.get(role)
        if isinstance(section, dict) and key in section:
            return (*where, role, key), section[key]
    return None


# What a failed check says, by the field it concerns (pydantic's own words otherwise).
_FIELD_MESSAGES = {
    "block_size": f"expected an integer from 2 to {MAX_BLOCK_SIZE}",
    "axis": "expected an integer axis or null",
    "batch_size": "expected a positive integer",
    "limit": "expected a positive integer",
    "max_float_nodes": "expected a positive integer",
    "samples": "expected a positive integer",
    "search_seconds": "expected a number of seconds above 0 (at most 86400)",
    "latency_runs": "expected an integer from 0 to 10000 (0: no timing)",
    "smoothquant_alpha": "expected a migration strength above 0 and at most 1",
    "exclude": "expected a list of node names",
}
_CHOICES = {
    "rounding": ("unknown rounding", ROUNDINGS),
    "granularity": ("unknown granularity", GRANULARITIES),
    "saturation": ("unknown saturation guard", SATURATION_GUARDS),
}


def located_error(e: ValidationError, error: Callable[..., QtoolError]) -> QtoolError:
    """The first validation error as a QtoolError at its YAML position, in qtool's words."""
    first = e.errors()[0]
    loc = tuple(str(p) for p in first["loc"])
    path = tuple("global" if p == "global_" else p for p in loc)
    kind, value = first["type"], first.get("input")
    if value is NULL:
        value = None
    field = path[-1] if path else ""
    parent = path[-2] if len(path) > 1 else ""
    shown = f"{value!r:.60}"
    if kind == "extra_forbidden":
        return error(path, f"unknown key '{field}'", hint=_allowed_hint(path), at_key=True)
    if kind == "value_error":
        return error(path, str(first["msg"]).removeprefix("Value error, "))
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        if parent in ("op_type", "node_name") or field in ("op_type", "node_name"):
            return error(path, f"expected a mapping of names to settings, got {type(value).__name__}")
        return error(path, f"expected a mapping, got {type(value).__name__}")
    if kind in ("bool_type", "bool_parsing"):
        return error(path, f"expected true or false, got {shown}")
    if kind == "literal_error":
        if field == "version":
            return error(path, f"unsupported config version {shown}", hint=f"this qtool reads version {CONFIG_VERSION}")
        if field == "dtype" and parent in ("weight", "activation"):
            choices: tuple[str, ...] = WEIGHT_DTYPES if parent == "weight" else ACTIVATION_DTYPES
            hint = f"choose one of: {', '.join(choices)}"
            if _is_float8_spelling(value):
                hint = f"write fp8_e4m3 for ONNX's FLOAT8E4M3FN, e5m2 is not offered; {hint}"
            return error(path, f"unsupported {parent} dtype {shown}", hint=hint)
        if field == "granularity" and parent == "activation":
            return error(path, "activations can only be quantized per_tensor")
        # the choices of this field's own type (kv_cache takes fewer granularities than a weight)
        expected = str(first.get("ctx", {}).get("expected", "")).replace("'", "").replace(" or ", ", ")
        if field in _CHOICES:
            words, choices = _CHOICES[field]
            return error(path, f"{words} {shown}", hint=f"choose one of: {expected or ', '.join(choices)}")
        return error(path, f"expected one of {expected}, got {shown}")
    for name in (field, parent):
        if name in _FIELD_MESSAGES:
            return error(path[: path.index(name) + 1], f"{_FIELD_MESSAGES[name]}, got {shown}")
    return error(path, f"{first['msg']}, got {shown}")


def _allowed_hint(path: tuple[str, ...]) -> str:
    """The keys allowed where an unknown one was found."""
    model: Any = ConfigDocument
    for part in path[:-1]:
        fields = {(f.alias or name): f for name, f in model.model_fields.items()}
        if part in fields:
            model = _model_of(fields[part].annotation)
        # a rule's name under op_type / node_name keeps the same model
        if model is None:
            return "see docs/configuration.md"
    keys = sorted((f.alias or name) for name, f in model.model_fields.items())
    return f"allowed keys: {', '.join(keys)}"


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside ``X | None`` or ``dict[str, X | None]``."""
    stack = [annotation]
    while stack:
        item = stack.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
        stack.extend(getattr(item, "__args__", ()))
    return None


@lru_cache(maxsize=512)
def compiled_pattern(pattern: str) -> Any:
    """A ``re:`` pattern compiled by RE2: matching takes time linear in the name, whatever the pattern.

    Python's ``re`` backtracks: ``(a+)+$`` against a long node name runs for minutes. RE2 has the
    same syntax but for backreferences and lookaround, which a node-name rule does not need.

    Raises:
        ValueError: not a pattern RE2 accepts (the message is RE2's).
    """
    options = re2.Options()
    options.log_errors = False  # RE2 would print parse errors to stderr; the caller reports them
    options.max_mem = 8 << 20
    try:
        return re2.compile(pattern, options=options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(reason) from None


def _is_float8_spelling(value: object) -> bool:
    """Whether a dtype the config refused is another name for float8 (``float8e4m3fn``, ``fp8``, ``e4m3``)."""
    squeezed = str(value).lower().replace("_", "").replace("-", "")
    return squeezed.startswith(("float8", "fp8", "f8")) or squeezed in ("e4m3", "e4m3fn", "e5m2")
