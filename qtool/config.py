"""YAML QConfigDict -> frozen, versioned dataclasses, with errors that point at file:line:col.

A user's file is merged over the built-in ``default.yaml``; every key it leaves
out keeps the default. Per-node settings resolve with the precedence
``node_name`` > ``op_type`` > ``global``; a ``null`` entry keeps a node in float.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import onnx.defs
import re2
import yaml

from qtool.errors import QtoolError
from qtool.files import CONFIG_MAX_BYTES, read_text

CONFIG_VERSION = 1
_MAX_YAML_NODES = 100_000  # refuses alias bombs long before they exhaust memory

_TOP_KEYS = {"version", "global", "op_type", "node_name", "exclude", "calibration", "accuracy", "preprocess"}
_SCHEME_KEYS = {"weight", "activation", "weight_only", "placement"}
PLACEMENTS = ("auto", "integer", "storage")
SATURATION_GUARDS = ("uint8", "reduce_range", "ignore")
MAX_BLOCK_SIZE = 1 << 20  # ONNX's block_size attribute is an int64; a block beyond any axis is a typo
_TENSOR_KEYS = {
    "weight": {"dtype", "granularity", "symmetric", "block_size", "axis", "saturation"},
    "activation": {"dtype", "granularity", "symmetric", "observer"},
}
_CALIBRATION_KEYS = {"observer", "batch_size", "limit"}
_ACCURACY_KEYS = {"target_sqnr_db", "max_float_nodes", "samples"}
WEIGHT_DTYPES = ("int8", "uint8", "int4", "uint4", "int2", "uint2", "fp16")
ACTIVATION_DTYPES = ("uint8", "int8", "uint16", "int16")  # what onnxruntime's QuantizeLinear executes on CPU
GRANULARITIES = ("per_tensor", "per_channel", "per_block")

Path_ = tuple[str, ...]
_ONNX_OPS = sorted({schema.name for schema in onnx.defs.get_all_schemas()})


@dataclass(frozen=True)
class TensorScheme:
    """How one tensor role (weight or activation) is quantized."""

    dtype: str
    granularity: str
    symmetric: bool
    block_size: int | None = None  # per_block only
    axis: int | None = None  # overrides the op's natural channel / block axis
    observer: str | dict[str, Any] | None = None  # activations: overrides calibration.observer
    saturation: str = "uint8"  # weights: uint8 | reduce_range | ignore (see qtool.plan.guard_saturation)

    @property
    def per_channel(self) -> bool:
        return self.granularity == "per_channel"

    @property
    def per_block(self) -> bool:
        return self.granularity == "per_block"

    @property
    def fp16(self) -> bool:
        return self.dtype == "fp16"

    def describe(self) -> str:
        """Short text such as ``int4 per_block(32) sym``."""
        if self.fp16:
            return "fp16"
        granularity = f"per_block({self.block_size})" if self.per_block else self.granularity
        return f"{self.dtype} {granularity} {'sym' if self.symmetric else 'asym'}"


@dataclass(frozen=True)
class NodeScheme:
    """The resolved quantization settings of one node, and the rule that decided them."""

    weight: TensorScheme
    activation: TensorScheme
    weight_only: bool = False
    rule: str = "global"
    placement: str = "auto"  # integer kernels, storage-only compression, or decided per node


@dataclass(frozen=True)
class CalibrationSettings:
    """How ``calibrate`` walks the dataset."""

    observer: str
    batch_size: int
    limit: int | None
    observer_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AccuracySettings:
    """The sensitivity search ``quantize`` runs when it has samples (see :mod:`qtool.sensitivity`)."""

    target_sqnr_db: float | None  # None: no search
    max_float_nodes: int
    samples: int


@dataclass(frozen=True)
class QConfig:
    """A validated QConfigDict. Build it with :func:`load_config`."""

    version: int
    global_scheme: NodeScheme
    op_type: dict[str, dict[str, Any] | None]
    node_name: dict[str, dict[str, Any] | None]
    exclude: tuple[str, ...]
    calibration: CalibrationSettings
    accuracy: AccuracySettings
    preprocess: dict[str, Any] | None
    source: str
    raw: dict[str, Any] = field(repr=False)
    sensitive_nodes: frozenset[str] = frozenset()  # chosen by the sensitivity search: activations kept float

    def resolve(self, node_name: str, op_type: str) -> tuple[NodeScheme | None, str]:
        """A node's settings (``None``: keep it in float) and the most specific rule that decided them.

        Rules read ``global``, ``op_type:<type>``, ``node_name:<pattern>`` or
        ``exclude:<pattern>``.
        """
        for pattern in self.exclude:
            if _name_matches(pattern, node_name):
                return None, f"exclude:{pattern}"
        matches: list[tuple[str, dict[str, Any] | None]] = [("global", self.raw["global"])]
        if op_type in self.op_type:
            matches.append((f"op_type:{op_type}", self.op_type[op_type]))
        for pattern, entry in self.node_name.items():
            if _name_matches(pattern, node_name):
                matches.append((f"node_name:{pattern}", entry))
        rule, most_specific = matches[-1]
        if most_specific is None:  # the most specific rule that matches says "keep in float"
            return None, rule
        merged: dict[str, Any] = {}
        for _, layer in matches:
            if layer is not None:
                merged = _deep_merge(merged, layer)
        scheme = NodeScheme(
            weight=TensorScheme(**merged["weight"]),
            activation=TensorScheme(**merged["activation"]),
            weight_only=bool(merged.get("weight_only", False)),
            placement=str(merged.get("placement", "auto")),
            rule=rule,
        )
        if node_name in self.sensitive_nodes and not scheme.weight_only:
            # Float activations, weights still stored quantized: the accuracy of float, most of the size gain.
            return replace(scheme, placement="storage", rule="sensitivity"), "sensitivity"
        return scheme, rule

    def scheme_for(self, node_name: str, op_type: str) -> NodeScheme | None:
        """Resolve a node's settings; ``None`` keeps the node in float."""
        return self.resolve(node_name, op_type)[0]

    def required_opset(self) -> int:
        """The lowest default-domain opset every scheme this config can produce needs."""
        return self.opset_requirement()[0]

    def opset_requirement(self) -> tuple[int, str]:
        """The lowest default-domain opset this config needs, and what needs it (for messages)."""
        need, why = 10, "QuantizeLinear/DequantizeLinear"
        for weight, activation in self._tensor_settings():
            for opset, reason in (
                (25, weight.get("dtype") in ("int2", "uint2") and f"{weight.get('dtype')} weights"),
                (21, weight.get("dtype") in ("int4", "uint4") and f"{weight.get('dtype')} weights"),
                (21, weight.get("granularity") == "per_block" and "per-block weights"),
                (21, activation.get("dtype") in ("int16", "uint16") and f"{activation.get('dtype')} activations"),
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
        entries = [self.raw["global"], *self.op_type.values(), *self.node_name.values()]
        return [
            (
                {**self.raw["global"]["weight"], **(entry.get("weight") or {})},
                {**self.raw["global"]["activation"], **(entry.get("activation") or {})},
            )
            for entry in entries
            if isinstance(entry, dict)
        ]

    def unmatched_node_patterns(self, node_names: list[str]) -> list[str]:
        """``node_name`` and ``exclude`` entries that match no node of the model."""
        patterns = list(self.node_name) + list(self.exclude)
        return [p for p in patterns if not any(_name_matches(p, n) for n in node_names)]


def _name_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return _compiled(pattern[3:]).fullmatch(name) is not None
    return pattern == name


@lru_cache(maxsize=512)
def _compiled(pattern: str) -> Any:
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


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# ------------------------------------------------------------------ YAML with marks
class _Located:
    """A YAML document as Python values plus the source position of every path."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.marks: dict[Path_, yaml.Mark] = {}  # where each value starts
        self.key_marks: dict[Path_, yaml.Mark] = {}  # where each mapping key starts
        self._nodes = 0
        self._constructor = yaml.SafeLoader("")
        self._open: set[int] = set()  # the collections being converted: an alias to one of them is a cycle
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
            self.value: Any = {} if root is None else self._convert(root, ())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            problem = getattr(e, "problem", None) or str(e)
            raise QtoolError(f"{where}: invalid YAML: {problem}") from e
        except RecursionError:  # composing and converting recurse once per nesting level
            raise QtoolError(f"{source}: YAML nests too deeply", hint="a config nests a few levels at most") from None

    def _convert(self, node: yaml.Node, path: Path_) -> Any:
        self._nodes += 1
        if self._nodes > _MAX_YAML_NODES:
            raise QtoolError(
                f"{self.source}: YAML document is too large (more than {_MAX_YAML_NODES} nodes)",
                hint="a config needs a few hundred nodes at most; check for recursive aliases",
            )
        self.marks[path] = node.start_mark
        if isinstance(node, yaml.ScalarNode):
            return self._construct(node)
        if id(node) in self._open:
            raise self.error(path, "a YAML alias refers to a collection that contains it", hint="remove the cycle")
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                # Merge keys (<<: *defaults) as yaml.safe_load reads them; a bad one is an "invalid YAML" error.
                self._constructor.flatten_mapping(node)
                result: dict[str, Any] = {}
                for key_node, value_node in node.value:
                    key = self._construct(key_node) if isinstance(key_node, yaml.ScalarNode) else None
                    if not isinstance(key, str):
                        raise QtoolError(f"{self._where_mark(key_node.start_mark)}: keys must be strings")
                    self.key_marks[path + (key,)] = key_node.start_mark  # noqa: RUF005 - mypy rejects (*path, key) here on 3.10
                    result[key] = self._convert(value_node, (*path, key))
                return result
            return [self._convert(item, (*path, str(i))) for i, item in enumerate(node.value)]
        finally:
            self._open.discard(id(node))

    def _construct(self, node: yaml.ScalarNode) -> Any:
        """A scalar's Python value; a tag its text does not fit (``!!int abc``, ``!foo``) is a located error."""
        try:
            return self._constructor.construct_object(node)
        except Exception as e:  # PyYAML raises ConstructorError, or ValueError, IndexError... from parsing the text
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise QtoolError(
                f"{self._where_mark(node.start_mark)}: cannot read {node.value!r} as {tag}",
                hint=f"fix the value or drop the {tag} tag",
            ) from e

    def _where_mark(self, mark: yaml.Mark) -> str:
        return f"{self.source}:{mark.line + 1}:{mark.column + 1}"

    def error(self, path: Path_, message: str, hint: str | None = None, *, at_key: bool = False) -> QtoolError:
        """A QtoolError located at the value (or, with ``at_key``, the key) of ``path``."""
        marks = self.key_marks if at_key else self.marks
        probe = path
        while probe and probe not in marks:
            probe = probe[:-1]
        mark = marks.get(probe) or self.marks.get(probe)
        where = self._where_mark(mark) if mark else self.source
        dotted = ".".join(path) or "<document>"
        return QtoolError(f"{where}: {dotted}: {message}", hint=hint)


# ------------------------------------------------------------------ validation
def _check_keys(doc: _Located, value: Any, path: Path_, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise doc.error(path, f"expected a mapping, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise doc.error(
                (*path, key), f"unknown key '{key}'", hint=f"allowed keys: {', '.join(sorted(allowed))}", at_key=True
            )
    return value


def _check_tensor_scheme(doc: _Located, value: Any, path: Path_, role: str) -> None:
    _check_keys(doc, value, path, _TENSOR_KEYS[role])
    dtypes = WEIGHT_DTYPES if role == "weight" else ACTIVATION_DTYPES
    if "dtype" in value and value["dtype"] not in dtypes:
        raise doc.error(
            (*path, "dtype"), f"unsupported {role} dtype {value['dtype']!r}", hint=f"choose one of: {', '.join(dtypes)}"
        )
    if "granularity" in value:
        if value["granularity"] not in GRANULARITIES:
            raise doc.error(
                (*path, "granularity"),
                f"unknown granularity {value['granularity']!r}",
                hint=f"choose one of: {', '.join(GRANULARITIES)}",
            )
        if role == "activation" and value["granularity"] != "per_tensor":
            raise doc.error((*path, "granularity"), "activations can only be quantized per_tensor")
    if "symmetric" in value and not isinstance(value["symmetric"], bool):
        raise doc.error((*path, "symmetric"), f"expected true or false, got {value['symmetric']!r}")
    if "saturation" in value and value["saturation"] not in SATURATION_GUARDS:
        raise doc.error(
            (*path, "saturation"),
            f"unknown saturation guard {value['saturation']!r}",
            hint=f"choose one of: {', '.join(SATURATION_GUARDS)}",
        )
    if "block_size" in value and value["block_size"] is not None:
        size = value["block_size"]
        if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= MAX_BLOCK_SIZE:
            raise doc.error(
                (*path, "block_size"),
                f"expected an integer from 2 to {MAX_BLOCK_SIZE}, got {size!r:.40}",
                hint="onnxruntime's MatMulNBits wants a power of two >= 16, e.g. 32 or 128",
            )
    if (
        "axis" in value
        and value["axis"] is not None
        and (not isinstance(value["axis"], int) or isinstance(value["axis"], bool))
    ):
        raise doc.error((*path, "axis"), f"expected an integer axis or null, got {value['axis']!r}")
    if value.get("observer") is not None:
        _check_observer(doc, value["observer"], (*path, "observer"))


def _check_node_scheme(doc: _Located, value: Any, path: Path_) -> None:
    if value is None:
        return
    _check_keys(doc, value, path, _SCHEME_KEYS)
    for role in ("weight", "activation"):
        if role in value:
            _check_tensor_scheme(doc, value[role], (*path, role), role)
    if "weight_only" in value and not isinstance(value["weight_only"], bool):
        raise doc.error((*path, "weight_only"), f"expected true or false, got {value['weight_only']!r}")
    if "placement" in value and value["placement"] not in PLACEMENTS:
        raise doc.error((*path, "placement"), f"expected one of {', '.join(PLACEMENTS)}, got {value['placement']!r}")


def _check_regex(doc: _Located, pattern: str, path: Path_, *, at_key: bool) -> None:
    if pattern.startswith("re:"):
        try:
            _compiled(pattern[3:])
        except (ValueError, OverflowError, RecursionError) as e:
            raise doc.error(
                path,
                f"invalid regular expression: {e}",
                hint="patterns use RE2 syntax (Python's, without backreferences and lookaround)",
                at_key=at_key,
            ) from e


def split_observer(value: Any) -> tuple[str, dict[str, Any]]:
    """``name`` or ``{name: ..., option: value}`` -> (name, options)."""
    if isinstance(value, str):
        return value, {}
    options = dict(value)
    return options.pop("name"), options


def _check_observer(doc: _Located, value: Any, path: Path_) -> None:
    """An observer is a name, or a mapping with ``name`` and its options; both must resolve."""
    from qtool.observers import create_observer  # the registry imports nothing of config

    if isinstance(value, dict):
        if not isinstance(value.get("name"), str):
            raise doc.error(path, "an observer mapping needs 'name: <observer>'")
    elif not isinstance(value, str):
        raise doc.error(path, f"expected an observer name or a mapping with 'name', got {value!r}")
    name, options = split_observer(value)
    try:
        create_observer(name, None, options)
    except QtoolError as e:
        raise doc.error(path, e.message, hint=e.hint) from e


def _check_preprocess(doc: _Located, value: Any) -> None:
    from qtool import preprocess as pre

    _check_keys(doc, value, ("preprocess",), set(pre.KEYS))
    choices = {"layout": pre.LAYOUTS, "channel_order": pre.CHANNEL_ORDERS, "dtype": pre.DTYPES}
    for key, allowed in choices.items():
        if key in value and value[key] not in allowed:
            raise doc.error(("preprocess", key), f"expected one of {', '.join(allowed)}, got {value[key]!r}")
    for key in ("resize", "center_crop"):
        if key in value:
            item = value[key]
            ok_int = isinstance(item, int) and not isinstance(item, bool) and item > 0
            ok_pair = isinstance(item, list) and len(item) == 2 and all(isinstance(v, int) and v > 0 for v in item)
            if not (ok_int or ok_pair):
                raise doc.error(("preprocess", key), f"expected a positive integer or [height, width], got {item!r}")
    for key in ("mean", "std"):
        if key in value:
            item = value[key]
            if (
                not isinstance(item, list)
                or len(item) not in (1, 3)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item)
            ):
                raise doc.error(("preprocess", key), f"expected a list of 1 or 3 numbers, got {item!r}")
            if key == "std" and any(v == 0 for v in item):
                raise doc.error(("preprocess", key), "std values must be non-zero")
    if "scale" in value and (not isinstance(value["scale"], (int, float)) or isinstance(value["scale"], bool)):
        raise doc.error(("preprocess", "scale"), f"expected a number, got {value['scale']!r}")


def _check_document(doc: _Located) -> None:
    value = _check_keys(doc, doc.value, (), _TOP_KEYS)
    if "version" in value and value["version"] != CONFIG_VERSION:
        raise doc.error(
            ("version",),
            f"unsupported config version {value['version']!r}",
            hint=f"this qtool reads version {CONFIG_VERSION}",
        )
    if "global" in value:
        _check_node_scheme(doc, value["global"], ("global",))
        if value["global"] is None:
            raise doc.error(("global",), "global cannot be null", hint="use op_type or exclude to keep nodes in float")
    for section in ("op_type", "node_name"):
        entries = value.get(section, {})
        if entries is None:
            continue
        if not isinstance(entries, dict):
            raise doc.error((section,), f"expected a mapping of names to settings, got {type(entries).__name__}")
        for key, entry in entries.items():
            _check_node_scheme(doc, entry, (section, key))
            _check_regex(doc, key, (section, key), at_key=True)
    exclude = value.get("exclude", [])
    if exclude is not None and (not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude)):
        raise doc.error(("exclude",), "expected a list of node names")
    for index, pattern in enumerate(exclude or []):
        _check_regex(doc, pattern, ("exclude", str(index)), at_key=False)
    for op_type in value.get("op_type") or {}:
        if not onnx.defs.has(op_type):
            close = difflib.get_close_matches(op_type, _ONNX_OPS, n=3)
            raise doc.error(
                ("op_type", op_type),
                f"unknown ONNX op type '{op_type}'",
                hint=f"did you mean {', '.join(close)}?" if close else "op types are case-sensitive",
                at_key=True,
            )
    if value.get("preprocess") is not None:
        _check_preprocess(doc, value["preprocess"])
    calibration = value.get("calibration", {})
    if calibration is not None:
        _check_keys(doc, calibration, ("calibration",), _CALIBRATION_KEYS)
        if "observer" in calibration:
            _check_observer(doc, calibration["observer"], ("calibration", "observer"))
        for key in ("batch_size", "limit"):
            number = calibration.get(key)
            if number is None and key == "limit":
                continue
            if key in calibration and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
                raise doc.error(("calibration", key), f"expected a positive integer, got {number!r}")
    accuracy = value.get("accuracy", {})
    if accuracy is not None:
        _check_keys(doc, accuracy, ("accuracy",), _ACCURACY_KEYS)
        target = accuracy.get("target_sqnr_db")
        if target is not None and (not isinstance(target, int | float) or isinstance(target, bool)):
            raise doc.error(("accuracy", "target_sqnr_db"), f"expected a number of dB or null, got {target!r}")
        for key in ("max_float_nodes", "samples"):
            number = accuracy.get(key)
            if key in accuracy and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
                raise doc.error(("accuracy", key), f"expected a positive integer, got {number!r}")


def _builtin_default_text() -> str:
    return resources.files("qtool").joinpath("configs/default.yaml").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _default_document() -> dict[str, Any]:
    doc = _Located("<built-in default.yaml>", _builtin_default_text())
    _check_document(doc)
    return doc.value


def load_config(path: Path | str | None = None) -> QConfig:
    """Read a QConfigDict YAML file (or only the built-in default when ``path`` is None).

    Args:
        path: the user's YAML file; its keys are merged over the default.

    Returns:
        The validated, frozen configuration.

    Raises:
        QtoolError: the file is missing, is not valid YAML, or breaks the schema
            (the message names file, line and column).
    """
    merged = _default_document()
    source = "<built-in default>"
    if path is not None:
        path = Path(path)
        text = read_text(path, "config file", CONFIG_MAX_BYTES)
        doc = _Located(str(path), text)
        _check_document(doc)
        user = {k: v for k, v in doc.value.items() if v is not None}
        merged = _deep_merge(merged, user)
        source = str(path)
    return _build(merged, source)


def _build(raw: dict[str, Any], source: str) -> QConfig:
    g = raw["global"]
    cal = raw["calibration"]
    acc = raw["accuracy"]
    return QConfig(
        version=raw["version"],
        global_scheme=NodeScheme(weight=TensorScheme(**g["weight"]), activation=TensorScheme(**g["activation"])),
        op_type=dict(raw.get("op_type") or {}),
        node_name=dict(raw.get("node_name") or {}),
        exclude=tuple(raw.get("exclude") or ()),
        preprocess=raw.get("preprocess"),
        calibration=CalibrationSettings(
            observer=split_observer(cal["observer"])[0],
            batch_size=cal["batch_size"],
            limit=cal["limit"],
            observer_options=split_observer(cal["observer"])[1],
        ),
        accuracy=AccuracySettings(
            target_sqnr_db=None if acc["target_sqnr_db"] is None else float(acc["target_sqnr_db"]),
            max_float_nodes=acc["max_float_nodes"],
            samples=acc["samples"],
        ),
        source=source,
        raw=raw,
    )
