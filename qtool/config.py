"""YAML QConfigDict -> frozen, versioned dataclasses, with errors that point at file:line:col.

A user's file is merged over the built-in ``default.yaml``; every key it leaves
out keeps the default. Per-node settings resolve with the precedence
``node_name`` > ``op_type`` > ``global``; a ``null`` entry keeps a node in float.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from qtool.config_files import resolve_config
from qtool.config_rules import deep_merge, merged_scheme, name_matches, node_scheme
from qtool.errors import QtoolError
from qtool.located_yaml import LocatedYaml
from qtool.schemas.config import FP8_DTYPES, ConfigDocument, NodeSettings
from qtool.schemas.config_checks import validate_document
from qtool.schemes import (
    TARGETS,
    AccuracyOptions,
    AutoPlacement,
    CacheGranularity,
    CalibrationSettings,
    NodeScheme,
    Rounding,
)
from qtool.system.files import CONFIG_MAX_BYTES, read_text


@dataclass(frozen=True)
class QConfig:
    """A validated QConfigDict. Build it with :func:`load_config`."""

    global_scheme: NodeScheme
    op_type: dict[str, NodeSettings | None]
    node_name: dict[str, NodeSettings | None]
    exclude: tuple[str, ...]
    calibration: CalibrationSettings
    accuracy: AccuracyOptions
    preprocess: dict[str, Any] | None
    source: str
    document: ConfigDocument = field(repr=False)  # the validated, merged document: what the fields above come from
    raw: dict[str, Any] = field(repr=False)  # the same document as written (YAML values): for --config-out and keys
    target: str = "cpu"  # cpu | cpu_vnni | cuda | tensorrt: whose rules the schemes follow (see :func:`for_target`)
    sensitive_nodes: frozenset[str] = frozenset()  # chosen by the sensitivity search: activations kept float
    float_nodes: frozenset[str] = frozenset()  # chosen by the sensitivity search: kept entirely float (weights too)
    auto_placement: AutoPlacement | None = None  # what every placement "auto" node becomes (a choice's candidate)
    # how every placement "auto" node rounded to nearest rounds its weight instead, its bias corrected for the rounding
    # (the choice's rounded storage-only)
    auto_rounding: Rounding | None = None
    auto_bias_correction: bool = True  # with auto_rounding: their biases corrected too (the kept integer one's are not)
    chains: bool = (
        True  # False: the ops placed "auto" between integer kernels stay float (qtool.quantization.plan.chains)
    )
    activation_ranges: str = (
        "observer"  # "observer" | "extremes" (see qtool.quantization.plan.activations): the choice's
    )
    # the digest of what the user gave, as the reports name it: the file's bytes, or a mapping's canonical JSON
    source_sha256: str | None = field(default=None, compare=False)
    located: LocatedYaml | None = field(default=None, repr=False, compare=False)  # the user's file: where keys are
    # each node's merged rules, by document: shared by the configs ``replace`` derives (a search's trials differ in
    # sensitive_nodes only, and merging the rules is most of what planning a node costs)
    merged_rules: dict[tuple[int, str, str, str], tuple[ConfigDocument, NodeScheme | None, str]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def kv_cache(self) -> CacheGranularity | None:
        """The granularity of a decoder's int8 key/value cache (its one dtype); None: the cache stays float."""
        section = self.document.kv_cache
        return section.granularity if section is not None else None

    def resolve(self, node_name: str, op_type: str) -> tuple[NodeScheme | None, str]:
        """A node's settings (``None``: keep it in float) and the most specific rule that decided them.

        Rules read ``global``, ``op_type:<type>``, ``node_name:<pattern>`` or
        ``exclude:<pattern>``.
        """
        for pattern in self.exclude:
            if name_matches(pattern, node_name):
                return None, f"exclude:{pattern}"
        if node_name in self.float_nodes:  # the search found its weights' rounding too costly as well
            return None, "sensitivity: float"
        key = (id(self.document), self.target, node_name, op_type)
        cached = self.merged_rules.get(key)
        if cached is None or cached[0] is not self.document:  # (a document of the same id is another one)
            rules = (self.global_settings, self.op_type, self.node_name)
            merged = merged_scheme(rules, (node_name, op_type), self.located, self.target)
            cached = self.merged_rules[key] = (self.document, *merged)
        _, scheme, rule = cached
        if scheme is None:
            return None, rule
        if self.auto_rounding is not None and scheme.placement == "auto" and scheme.algorithms.rounding == "nearest":
            # the placement choice's storage-only candidate with rounded weights, the mean output shift their rounding
            # causes cancelled in each bias (analytic for float inputs: no model run; see qtool.choice.rounded)
            rounded = replace(scheme.algorithms, rounding=self.auto_rounding, bias_correction=self.auto_bias_correction)
            scheme = replace(scheme, algorithms=rounded)
        if node_name in self.sensitive_nodes and not scheme.weight_only:
            # Float activations, weights still stored quantized: the accuracy of float, most of the size gain.
            return replace(scheme, placement="storage", rule="sensitivity"), "sensitivity"
        chosen = self.auto_placement
        if chosen is not None and scheme.placement == "auto" and not scheme.weight_only:
            if chosen == "dynamic":
                # The dynamic candidate of the placement choice: where "auto" places an integer MatMul/Gemm,
                # its input is quantized at run time.
                return replace(scheme, mode="dynamic", rule="choice:dynamic"), rule
            # A candidate of the placement choice (see qtool.choice.selection).
            return replace(scheme, placement=chosen, rule=f"choice:{chosen}"), rule
        return scheme, rule

    @property
    def global_settings(self) -> NodeSettings:
        """The ``global:`` section, complete (merged over the default)."""
        assert self.document.global_ is not None  # the default document has one
        return self.document.global_

    def with_target(self, target: str | None) -> QConfig:
        """The config for ``target`` instead (None: as configured); see :func:`for_target`."""
        if target is None or target == self.target:
            return self
        if target not in TARGETS:
            raise QtoolError(f"unknown target '{target}'", hint=f"choose one of: {', '.join(TARGETS)}")
        document = self.document.model_copy(update={"target": target})
        changed = replace(self, target=target, document=document, raw={**self.raw, "target": target})
        _check_target(changed)
        return changed

    def scheme_for(self, node_name: str, op_type: str) -> NodeScheme | None:
        """Resolve a node's settings; ``None`` keeps the node in float."""
        return self.resolve(node_name, op_type)[0]

    def opset_requirement(self) -> tuple[int, str]:
        """The lowest default-domain opset this config needs, and what needs it (for messages)."""
        need, why = 10, "QuantizeLinear/DequantizeLinear"
        for weight, activation in self._tensor_settings():
            for opset, reason in (
                (25, weight.get("dtype") in ("int2", "uint2") and f"{weight.get('dtype')} weights"),
                (21, weight.get("dtype") in ("int4", "uint4") and f"{weight.get('dtype')} weights"),
                (21, weight.get("granularity") == "per_block" and "per-block weights"),
                (21, activation.get("dtype") in ("int16", "uint16") and f"{activation.get('dtype')} activations"),
                (19, weight.get("dtype") in FP8_DTYPES and f"{weight.get('dtype')} weights"),
                (19, activation.get("dtype") in FP8_DTYPES and f"{activation.get('dtype')} activations"),
                (13, weight.get("granularity") == "per_channel" and "per-channel weights"),
            ):
                if reason and opset > need:
                    need, why = opset, reason
        return need, why

    def quantized_dtypes(self) -> tuple[frozenset[str], frozenset[str]]:
        """(activation dtypes, weight dtypes) that Q/DQ nodes of this config can carry (fp16 excluded)."""
        activations: set[str] = set()
        weights: set[str] = set()
        for weight, activation in self._tensor_settings():
            if weight.get("dtype") != "fp16":
                weights.add(str(weight.get("dtype")))
            activations.add(str(activation.get("dtype")))
        return frozenset(activations), frozenset(weights)

    def observer_references(self) -> frozenset[str]:
        """Every observer this config names (calibration.observer and per-rule activation observers)."""
        names = {self.calibration.observer}
        for _, activation in self._tensor_settings():
            if activation.get("observer") is not None:
                names.add(split_observer(activation["observer"])[0])
        return frozenset(names)

    def _tensor_settings(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Each rule's weight and activation settings, completed by ``global``."""
        base = self.global_settings.model_dump()
        entries = [self.global_settings, *self.op_type.values(), *self.node_name.values()]
        settings = []
        for entry in entries:
            if entry is None:
                continue
            given = entry.model_dump(exclude_unset=True)
            settings.append(
                (
                    {**base["weight"], **(given.get("weight") or {})},
                    {**base["activation"], **(given.get("activation") or {})},
                )
            )
        return settings

    def with_rules(
        self,
        *,
        global_: Mapping[str, Any] | None = None,
        op_type: Mapping[str, NodeSettings | None] | None = None,
        node_name: Mapping[str, NodeSettings | None] | None = None,
        exclude: tuple[str, ...] | None = None,
    ) -> QConfig:
        """The config with rules replaced, built as objects (no YAML round trip).

        ``global_`` is laid over the current global settings (only the keys it gives change).
        """
        update: dict[str, Any] = {}
        if global_ is not None:
            merged = deep_merge(self.global_settings.model_dump(exclude_unset=True), dict(global_))
            update["global_"] = NodeSettings.model_validate(merged)
        if op_type is not None:
            update["op_type"] = dict(op_type)
        if node_name is not None:
            update["node_name"] = dict(node_name)
        if exclude is not None:
            update["exclude"] = list(exclude)
        document = self.document.model_copy(update=update)
        built = _from_document(document, self.raw, self.source)  # raw: the base as written (for keys and text)
        return replace(built, **{name: getattr(self, name) for name in _DECIDED_FIELDS})

    def unmatched_node_patterns(self, node_names: list[str]) -> list[str]:
        """``node_name`` and ``exclude`` entries that match no node of the model."""
        patterns = list(self.node_name) + list(self.exclude)
        return [p for p in patterns if not any(name_matches(p, n) for n in node_names)]


# ------------------------------------------------------------------ validation


# What a config carries beside its document: where the user's file put each key, and what the measured choices and the
# search decided. New rules (:meth:`QConfig.with_rules`) keep them.
_DECIDED_FIELDS = (
    "located",
    "sensitive_nodes",
    "float_nodes",
    "auto_placement",
    "auto_rounding",
    "auto_bias_correction",
    "chains",
    "activation_ranges",
)


def split_observer(value: Any) -> tuple[str, dict[str, Any]]:
    """``name`` or ``{name: ..., option: value}`` -> (name, options)."""
    if isinstance(value, str):
        return value, {}
    options = dict(value)
    return options.pop("name"), options


def _check_document(doc: LocatedYaml) -> None:
    """Validate against :class:`qtool.schemas.config.ConfigDocument`, errors at their YAML line."""
    validate_document(doc.value, doc.error)


def _builtin_default_text() -> str:
    return resources.files("qtool").joinpath("configs/default.yaml").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _default_document() -> dict[str, Any]:
    doc = LocatedYaml("<built-in default.yaml>", _builtin_default_text())
    _check_document(doc)
    return doc.value


def load_config(path: Path | str | Mapping[str, Any] | None = None) -> QConfig:
    """Read a QConfigDict YAML file (or only the built-in default when ``path`` is None).

    Args:
        path: the user's YAML file, or the same document as a mapping (the Python API); its keys
            are merged over the default.

    Returns:
        The validated, frozen configuration.

    Raises:
        QtoolError: the file is missing, is not valid YAML, or breaks the schema
            (the message names file, line and column).
    """
    merged = _default_document()
    source = "<built-in default>"
    if isinstance(path, Mapping):
        # A config given as a dict (the Python API) is checked as its YAML form; errors name its keys.
        try:
            text = yaml.safe_dump(dict(path), sort_keys=False)
        except yaml.YAMLError as e:
            raise QtoolError(f"the config mapping holds a value YAML cannot hold: {e}") from None
        doc = LocatedYaml("<config mapping>", text)
        _check_document(doc)
        user = _without_default_nulls({k: v for k, v in doc.value.items() if v is not None})
        digest = hashlib.sha256(json.dumps(dict(path), sort_keys=True, default=str).encode()).hexdigest()
        return replace(_build(deep_merge(merged, user), "<config mapping>"), located=doc, source_sha256=digest)
    if path is not None:
        path = resolve_config(path)
        text = read_text(path, "config file", CONFIG_MAX_BYTES)
        doc = LocatedYaml(str(path), text)
        _check_document(doc)
        user = _without_default_nulls({k: v for k, v in doc.value.items() if v is not None})
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        return replace(_build(deep_merge(merged, user), str(path)), located=doc, source_sha256=digest)
    return _build(merged, source)


def _check_target(config: QConfig) -> None:
    """Refuse settings the config's target cannot run, naming the rule."""
    if config.target != "tensorrt":
        return
    rules: list[tuple[str, NodeSettings | None]] = [("global", config.global_settings)]
    rules += [(f"op_type:{k}", v) for k, v in config.op_type.items()]
    rules += [(f"node_name:{k}", v) for k, v in config.node_name.items()]
    for rule, entry in rules:
        if entry is None:
            continue
        if entry.mode == "dynamic":
            raise QtoolError(
                f"{config.source}: rule {rule} asks for mode: dynamic, which TensorRT does not run",
                hint="remove it (TensorRT quantizes activations statically) or use --target cpu",
            )
        if entry.weight is not None and entry.weight.format == "matmul_nbits":
            raise QtoolError(
                f"{config.source}: rule {rule} writes onnxruntime's MatMulNBits, which TensorRT does not run",
                hint="use weight.format: qdq for TensorRT",
            )


def _from_document(document: ConfigDocument, raw: dict[str, Any], source: str) -> QConfig:
    """The config a complete, validated document describes."""
    assert document.global_ is not None and document.calibration is not None and document.accuracy is not None
    cal, acc = document.calibration, document.accuracy
    assert cal.observer is not None and cal.batch_size is not None  # complete: merged over the default
    assert acc.max_float_nodes is not None and acc.samples is not None and acc.search_seconds is not None
    assert acc.latency_runs is not None
    observer, observer_options = split_observer(cal.observer)
    config = QConfig(
        global_scheme=node_scheme(document.global_.model_dump(), "global"),
        op_type=dict(document.op_type or {}),
        node_name=dict(document.node_name or {}),
        exclude=tuple(document.exclude or ()),
        preprocess=document.preprocess.model_dump(exclude_unset=True) if document.preprocess is not None else None,
        calibration=CalibrationSettings(observer, cal.batch_size, cal.limit, observer_options),
        accuracy=AccuracyOptions(
            target_sqnr_db=acc.target_sqnr_db,
            max_float_nodes=acc.max_float_nodes,
            samples=acc.samples,
            search_seconds=float(acc.search_seconds),
            latency_runs=acc.latency_runs,
            outputs=tuple(acc.outputs or ()),
            state=tuple((acc.state or {}).items()),
        ),
        source=source,
        document=document,
        raw=raw,
        target=document.target or "cpu",
    )
    _check_target(config)
    return config


def _build(raw: dict[str, Any], source: str) -> QConfig:
    """Validate the merged document (values as the schema types them) and build the config from it."""
    return _from_document(ConfigDocument.model_validate(raw), raw, source)


def _without_default_nulls(document: dict[str, Any]) -> dict[str, Any]:
    """A user's ``document`` without the nulls that mean "the default" (``weight.block_size``): merged, they keep it."""

    def clean(settings: Any) -> Any:
        if isinstance(settings, dict) and isinstance(settings.get("weight"), dict):
            weight = {k: v for k, v in settings["weight"].items() if not (k == "block_size" and v is None)}
            return {**settings, "weight": weight}
        return settings

    cleaned = dict(document)
    if "global" in document:
        cleaned["global"] = clean(document["global"])
    for section in ("op_type", "node_name"):
        if isinstance(document.get(section), dict):
            cleaned[section] = {k: clean(v) for k, v in document[section].items()}
    return cleaned
