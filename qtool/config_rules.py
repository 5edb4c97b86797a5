"""How a node's rules merge: ``global`` < ``op_type`` < ``node_name``, laid over each other into its scheme."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qtool.located_yaml import LocatedYaml
from qtool.schemas.config import FP8_DTYPES, NodeSettings
from qtool.schemas.config_checks import check_merged_rules, compiled_pattern
from qtool.schemes import Algorithms, NodeScheme, TensorScheme, for_target


def name_matches(pattern: str, name: str) -> bool:
    """Whether a ``node_name``/``exclude`` entry (exact, or ``re:`` RE2 pattern) names ``name``."""
    if pattern.startswith("re:"):
        return compiled_pattern(pattern[3:]).fullmatch(name) is not None
    return pattern == name


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` laid over ``base``, nested mappings key by key."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def node_scheme(settings: dict[str, Any], rule: str) -> NodeScheme:
    """A node's scheme from its complete settings (global, then every rule that matches, laid over it).

    fp8 is symmetric whatever ``symmetric`` says (the default's ``false`` for activations; the
    user's own ``false`` is refused when the file is read).
    """

    def tensor(values: dict[str, Any]) -> TensorScheme:
        return TensorScheme(**{**values, "symmetric": values["dtype"] in FP8_DTYPES or values["symmetric"]})

    return NodeScheme(
        weight=tensor(settings["weight"]),
        activation=tensor(settings["activation"]),
        weight_only=settings["weight_only"],
        placement=settings["placement"],
        algorithms=Algorithms(**settings["algorithms"]),
        mode=settings["mode"],
        rule=rule,
    )


def merged_scheme(
    rules: tuple[NodeSettings, Mapping[str, NodeSettings | None], Mapping[str, NodeSettings | None]],
    node: tuple[str, str],
    located: LocatedYaml | None,
    target: str,
) -> tuple[NodeScheme | None, str]:
    """The scheme of ``node`` (name, op type) under ``rules`` (global, op_type, node_name) for ``target``.

    Returns the scheme (None: the most specific rule that matches keeps it float) and that rule.
    Raises a located QtoolError for rules that cannot be laid over each other.
    """
    global_settings, op_types, node_names = rules
    name, op_type = node
    matches: list[tuple[str, NodeSettings | None]] = [("global", global_settings)]
    if op_type in op_types:
        matches.append((f"op_type:{op_type}", op_types[op_type]))
    for pattern, entry in node_names.items():
        if name_matches(pattern, name):
            matches.append((f"node_name:{pattern}", entry))
    rule, most_specific = matches[-1]
    if most_specific is None:
        return None, rule
    layers = [(label, layer.model_dump(exclude_unset=True)) for label, layer in matches if layer is not None]
    check_merged_rules(layers, located, name)
    merged: dict[str, Any] = {}
    for _, values in layers:
        merged = deep_merge(merged, values)
    return for_target(node_scheme(merged, rule), target), rule
