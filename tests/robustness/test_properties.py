"""Properties that must hold for any input: the quantization math for every dtype and granularity, and config parsing.

The numerics are cross-checked with onnx's ReferenceEvaluator (QuantizeLinear / DequantizeLinear,
opset 25, which knows every type in ``QUANT_TYPES``, int2 and block-wise included); config parsing
must turn whatever a file holds into a config or a :class:`QtoolError`, never another exception.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool import config as qconfig
from qtool.errors import QtoolError
from qtool.numerics.qparams import (
    QUANT_TYPES,
    QParams,
    QuantType,
    compute_qparams,
    dequantize,
    quantize,
    to_tensor_proto,
    weight_range,
)
from qtool.numerics.ranges import _grouped, mse_weight_range
from qtool.observers.base import builtin_observers, observer_options
from qtool.schemas import config as schema
from tests.conftest import ROOT

EPS32 = float(np.finfo(np.float32).eps)
REFERENCE_OPSET = 25  # QuantizeLinear / DequantizeLinear with int2/uint2, int4/uint4, 16-bit and block_size


# ------------------------------------------------------------------ quantization math
@st.composite
def quant_cases(draw: st.DrawFn) -> tuple[np.ndarray, QParams]:
    """A float32 tensor and the QParams its own range gives, for any integer dtype, granularity and scheme.

    float8 types have their own contract (symmetric, a float grid): tests/numerics/test_qparams_fp8.py.
    """
    qtype = draw(st.sampled_from([t for t in QUANT_TYPES.values() if not t.float8]))
    symmetric, narrow = draw(st.booleans()), draw(st.booleans())
    granularity = draw(st.sampled_from(["per_tensor", "per_channel", "per_block"]))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    axis = None if granularity == "per_tensor" else draw(st.integers(0, len(shape) - 1))
    block = draw(st.integers(2, 6)) if granularity == "per_block" else None  # may exceed the axis: one short block
    magnitude = draw(st.sampled_from([1e-38, 1e-6, 1.0, 1e4, 1e30]))
    shift = draw(st.sampled_from([0.0, 0.0, 1.0, -1.0]))  # one-sided ranges, which must still contain zero
    unit = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    x = ((unit + np.float32(shift)) * np.float32(magnitude)).astype(np.float32)
    lo, hi = weight_range(x, axis, block)
    base = compute_qparams(lo, hi, qtype, symmetric=symmetric, narrow_range=narrow, axis=axis)
    return x, QParams(base.scale, base.zero_point, qtype, axis, block, base.narrow)


def _expanded(qp: QParams, values: np.ndarray, like: np.ndarray) -> np.ndarray:
    length = like.shape[qp.axis] if qp.axis is not None else 0
    return np.broadcast_to(qp.expand(values, like.ndim, length), like.shape)


def _reference(node: str, data: np.ndarray, qp: QParams) -> np.ndarray:
    """Run one QuantizeLinear (``data`` float) or DequantizeLinear (``data`` codes) in onnx's reference evaluator."""
    attrs: dict[str, int] = {}
    if qp.axis is not None:
        attrs["axis"] = qp.axis
    if qp.block_size is not None:
        attrs["block_size"] = qp.block_size
    inits = [numpy_helper.from_array(qp.scale, "scale"), to_tensor_proto(qp.zero_point, qp.qtype, "zero")]
    if node == "QuantizeLinear":
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, data.shape)]
        out_type = qp.qtype.onnx_type
        feed = {"x": data}
    else:
        inits.append(to_tensor_proto(data, qp.qtype, "x"))  # packed as qtool writes it: checks the packing too
        inputs, out_type, feed = [], TensorProto.FLOAT, {}
    graph = helper.make_graph(
        [helper.make_node(node, ["x", "scale", "zero"], ["y"], **attrs)],
        "g",
        inputs,
        [helper.make_tensor_value_info("y", out_type, None)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", REFERENCE_OPSET)])
    return np.asarray(ReferenceEvaluator(model).run(None, feed)[0])


@settings(max_examples=250, deadline=None)
@given(case=quant_cases())
def test_qparams_quantize_and_dequantize_hold_their_contract_for_every_dtype_and_granularity(case):
    x, qp = case
    qtype, qmin, qmax = qp.qtype, qp.qmin, qp.qtype.qmax
    lo, _ = weight_range(x, qp.axis, qp.block_size)
    assert qp.scale.shape == np.shape(lo) and qp.zero_point.shape == np.shape(lo)
    assert qp.scale.dtype == np.float32 and np.all(np.isfinite(qp.scale)) and np.all(qp.scale > 0)
    assert qp.zero_point.dtype == qtype.numpy_dtype
    assert np.all(qp.zero_point >= qmin) and np.all(qp.zero_point <= qmax)
    if qp.narrow:
        assert qtype.signed and qmin == -qmax

    q = quantize(x, qp)
    assert q.dtype == qtype.numpy_dtype and q.shape == x.shape
    assert np.all(q >= qmin) and np.all(q <= qmax)

    # Inside the range: back within half a step (plus float32 rounding of x / scale and of (q - zp) * scale).
    scale = _expanded(qp, qp.scale, x).astype(np.float64)
    restored = dequantize(q, qp)
    tolerance = scale / 2 + 8 * EPS32 * (np.abs(x) + scale)
    assert np.all(np.abs(restored.astype(np.float64) - x) <= tolerance), (x, restored, qp)

    # Zero is exactly representable, wherever it sits in the tensor.
    zeros = np.zeros_like(x)
    assert np.all(dequantize(quantize(zeros, qp), qp) == 0.0)
    assert np.all(restored[x == 0] == 0.0)

    # Outside the range: the end codes (qmin is -qmax with a narrow range), never a wrap-around.
    top = dequantize(np.full(x.shape, qmax, np.int64), qp).astype(np.float64)
    bottom = dequantize(np.full(x.shape, qmin, np.int64), qp).astype(np.float64)
    for steps in (0.75, 3.0, 1e4):
        above = (top + steps * scale).astype(np.float32)
        below = (bottom - steps * scale).astype(np.float32)
        assert np.all(quantize(above, qp) == qmax)
        assert np.all(quantize(below, qp) == qmin)

    # onnx's reference agrees on the codes (x is inside the range, where a narrow range changes nothing)
    # and on the values, reading the codes packed as qtool stores them.
    reference_q = _reference("QuantizeLinear", x, qp).astype(np.int64)
    np.testing.assert_array_equal(reference_q, q.astype(np.int64))
    np.testing.assert_array_equal(_reference("DequantizeLinear", q, qp), restored)


@settings(max_examples=60, deadline=None)
@given(case=quant_cases(), data=st.data())
def test_quantize_is_monotonic_in_its_input(case, data):
    x, qp = case
    steps = data.draw(hnp.arrays(np.float32, x.shape, elements=st.floats(0, 4, width=32)))
    larger = (x + steps * _expanded(qp, qp.scale, x)).astype(np.float32)
    assert np.all(quantize(larger, qp).astype(np.int64) >= quantize(x, qp).astype(np.int64))


@settings(max_examples=60, deadline=None)
@given(case=quant_cases(), symmetric=st.booleans())
@pytest.mark.filterwarnings("ignore:overflow encountered in square:RuntimeWarning")  # the MSE of 1e30 weights is inf
def test_block_and_mse_ranges_group_values_like_weight_range(case, symmetric):
    x, qp = case
    lo, hi = weight_range(x, qp.axis, qp.block_size)
    groups, shape = _grouped(x, qp.axis, qp.block_size)
    group_lo, group_hi = groups.min(axis=1).reshape(shape), groups.max(axis=1).reshape(shape)
    if qp.axis is not None and qp.block_size is not None:
        group_lo, group_hi = np.moveaxis(group_lo, -1, qp.axis), np.moveaxis(group_hi, -1, qp.axis)
    # _grouped pads a short last block with zeros; ranges always get widened to zero, so both agree after that.
    np.testing.assert_array_equal(np.minimum(lo, 0), np.minimum(group_lo, 0))
    np.testing.assert_array_equal(np.maximum(hi, 0), np.maximum(group_hi, 0))
    mse_lo, mse_hi = mse_weight_range(x, qp.qtype, symmetric=symmetric, axis=qp.axis, block_size=qp.block_size)
    assert mse_lo.shape == np.shape(lo) and mse_hi.shape == np.shape(hi)
    # A fraction of each group's own range: shrunk towards zero, never widened.
    assert np.all(np.abs(mse_lo) <= np.abs(group_lo)) and np.all(np.abs(mse_hi) <= np.abs(group_hi))
    assert np.all(np.sign(mse_lo) * np.sign(group_lo) >= 0) and np.all(np.sign(mse_hi) * np.sign(group_hi) >= 0)


@pytest.mark.parametrize("qtype", [QUANT_TYPES[n] for n in ("int8", "uint8", "int4")], ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_values_far_beyond_the_range_saturate_to_the_right_end(qtype: QuantType):
    qp = compute_qparams(-1.0, 1.0, qtype, symmetric=False)
    far = np.array([1e19, 1e30, np.inf], np.float32)
    assert quantize(far, qp).tolist() == [qtype.qmax] * 3
    assert quantize(-far, qp).tolist() == [qtype.qmin] * 3


# ------------------------------------------------------------------ config parsing
def _fields(model: Any) -> set[str]:
    """The YAML keys of a config model (its aliases: ``global`` for ``global_``)."""
    return {field.alias or name for name, field in model.model_fields.items()}


def _schema_keys() -> list[str]:
    """Every key the config schema and the shipped configs use (observer option names left out: see below)."""
    keys = {"name"}
    for model in (schema.ConfigDocument, schema.NodeSettings, schema.CalibrationSection, schema.AccuracySection,
                  schema.PreprocessSection, schema.WeightSettings, schema.ActivationSettings):  # fmt: skip
        keys |= _fields(model)

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            keys.update(k for k in value if isinstance(k, str))
            for item in value.values():
                walk(item)

    for path in (ROOT / "configs").glob("*.yaml"):
        walk(yaml.safe_load(path.read_text(encoding="utf-8")))
    return sorted(keys)


SHIPPED_CONFIGS = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted((ROOT / "configs").glob("*.yaml"))]
WORDS = [
    *schema.WEIGHT_DTYPES,
    *schema.ACTIVATION_DTYPES,
    *schema.GRANULARITIES,
    *schema.PLACEMENTS,
    *builtin_observers(),
    *schema.LAYOUTS,
    *schema.CHANNEL_ORDERS,
    *schema.PREPROCESS_DTYPES,
    "Conv",
    "MatMul",
    "Gemm",
    "conv",  # a near miss
    "head/gemm",
    "re:.*",
    "re:(head|fc2)/.*",
    "re:(",  # invalid regular expressions
    "re:a{99999999999}",
    "re:" + "(" * 300 + ")" * 300,
    "qtool.observers.minmax:MinMaxObserver",  # a package.module:ClassName reference
    "os:path",  # importable, but not an observer
    "no_such_module_for_qtool_tests:Observer",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(WORDS)
)
keys = st.sampled_from(_schema_keys()) | st.text(max_size=8)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=16
)


def _observers() -> st.SearchStrategy[Any]:
    """Observer names and ``{name: ..., option: value}`` mappings with in-range option values.

    Values that overflow (``candidates: .inf``) or that allocate without bound (``bins: 2**40``)
    have their own test below, so that this property keeps looking for other bugs.
    """
    mappings = [
        st.fixed_dictionaries(
            {"name": st.just(name)},
            optional={
                option: st.none() | st.booleans() | st.integers(-10, 4096) | st.floats(-1e3, 1e3) | st.text(max_size=4)
                for option in observer_options(cls)
            },
        )
        for name, cls in builtin_observers().items()
    ]
    return st.sampled_from(WORDS) | st.one_of(mappings) | scalars


def _tensor(role: str) -> st.SearchStrategy[dict[str, Any]]:
    leaf: dict[str, st.SearchStrategy[Any]] = {
        "dtype": st.sampled_from(schema.WEIGHT_DTYPES + schema.ACTIVATION_DTYPES) | scalars,
        "granularity": st.sampled_from(schema.GRANULARITIES) | scalars,
        "symmetric": st.booleans() | scalars,
        "block_size": st.sampled_from([None, 2, 16, 32, 128]) | scalars,
        "axis": st.sampled_from([None, 0, 1, -1]) | scalars,
        "saturation": st.sampled_from(schema.SATURATION_GUARDS) | scalars,
        "final_layer_int8": st.booleans() | scalars,
        "format": st.sampled_from(["qdq", "matmul_nbits"]) | scalars,
        "accuracy_level": st.integers(-1, 5) | scalars,
        "observer": _observers(),
    }
    model = schema.WeightSettings if role == "weight" else schema.ActivationSettings
    return st.fixed_dictionaries({}, optional={key: leaf[key] for key in sorted(_fields(model))})


node_scheme = st.none() | st.fixed_dictionaries(
    {},
    optional={
        "weight": _tensor("weight") | values,
        "activation": _tensor("activation") | values,
        "weight_only": st.booleans() | scalars,
        "placement": st.sampled_from(schema.PLACEMENTS) | scalars,
        "mode": st.sampled_from(["static", "dynamic"]) | scalars,
    },
)
size = st.integers(1, 512) | st.lists(st.integers(1, 512), min_size=2, max_size=2) | scalars
numbers = st.lists(st.floats(-2, 2) | st.integers(-1, 255), min_size=1, max_size=3) | scalars
documents = st.fixed_dictionaries(
    {},
    optional={
        "version": st.just(1) | scalars,
        "global": node_scheme | values,
        "op_type": st.dictionaries(st.sampled_from(["Conv", "MatMul", "Gemm", "Relu", "conv", "NoSuchOp"]), node_scheme)
        | values,
        "node_name": st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=6), node_scheme) | values,
        "exclude": st.lists(st.sampled_from(WORDS) | st.text(max_size=6), max_size=3) | values,
        "calibration": st.fixed_dictionaries(
            {},
            optional={
                "observer": _observers(),
                "batch_size": st.integers(-1, 64) | scalars,
                "limit": st.integers(-1, 64) | scalars,
            },
        )
        | values,
        "accuracy": st.fixed_dictionaries(
            {},
            optional={
                "target_sqnr_db": st.floats(allow_nan=True) | scalars,
                "max_float_nodes": st.integers(-1, 8) | scalars,
                "samples": st.integers(-1, 8) | scalars,
            },
        )
        | values,
        "preprocess": st.fixed_dictionaries(
            {},
            optional={
                "resize": size,
                "center_crop": size,
                "scale": st.floats(allow_nan=True) | scalars,
                "mean": numbers,
                "std": numbers,
                "channel_order": st.sampled_from(schema.CHANNEL_ORDERS) | scalars,
                "layout": st.sampled_from(schema.LAYOUTS) | scalars,
                "dtype": st.sampled_from(schema.PREPROCESS_DTYPES) | scalars,
            },
        )
        | values,
    },
)


@st.composite
def shipped_config_variants(draw: st.DrawFn) -> Any:
    """One of configs/*.yaml with one value somewhere in it replaced by anything."""
    doc = draw(st.sampled_from(SHIPPED_CONFIGS))
    paths: list[tuple[Any, ...]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*path, key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, (*path, index))

    walk(doc, ())
    path = draw(st.sampled_from(paths[1:] or [()]))
    replacement = draw(values | node_scheme | documents)
    if not path:
        return replacement
    doc = yaml.safe_load(yaml.safe_dump(doc))  # a copy
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = replacement
    return doc


# Hand-written YAML that exercises what safe_dump never writes: tags, anchors, merge keys, directives, nesting.
TRICKY_YAML = [
    "version: !!int abc\n",
    "version: !!float abc\n",
    "version: !!bool maybe\n",
    "version: !!timestamp abc\n",
    "version: !!binary '!!'\n",
    "version: !!python/object/apply:os.system [echo pwned]\n",
    "version: !custom 1\n",
    "global: !!set {a, b}\n",
    "exclude: !!omap [a: 1]\n",
    "<<: {version: 1}\n",
    "<<: 5\n",
    "base: &b {dtype: int4}\nglobal: {weight: {<<: *b}}\n",
    "global: &g {weight: *g}\n",
    "exclude: &a [*a]\n",
    "op_type: &o {Conv: *o}\n",
    "%YAML 1.1\n---\nversion: 1\n",
    "version: 1\n---\nversion: 1\n",
    "? [a, b]\n: 1\n",
    "? {a: 1}\n: 1\n",
    "2024-01-01: 1\n",
    "exclude: " + "[" * 2000 + "]" * 2000 + "\n",
    "global: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n",
    'exclude: ["re:' + "(" * 2000 + ")" * 2000 + '"]\n',
    "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
    "\ufeffversion: 1\n",
    "version: 1\x00\n",
    "\t- a\n",
]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("configs") / "config.yaml"


def _load_and_use(path: Path) -> None:
    """Load a config; when it loads, every query the planner makes of it must work too."""
    try:
        config = qconfig.load_config(path)
    except QtoolError as e:
        assert str(e).strip()
        return
    for name, op in [("block0/conv", "Conv"), ("head/gemm", "Gemm"), ("fc0/matmul", "MatMul"), ("x", "Relu")]:
        scheme, rule = config.resolve(name, op)
        assert rule
        if scheme is not None:
            scheme.weight.describe()
            scheme.activation.describe()
    assert config.opset_requirement()[0] >= 10
    config.unmatched_node_patterns(["block0/conv", "head/gemm"])


def _check(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    try:
        _load_and_use(path)
    except Exception as e:  # the property: load_config raises nothing but QtoolError, a loaded config nothing
        raise AssertionError(f"load_config raised {type(e).__name__}: {e}\n--- config ---\n{text}") from e


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents | shipped_config_variants() | values, flow=st.booleans())
def test_any_yaml_document_loads_or_is_a_qtool_error(config_file, doc, flow):
    _check(config_file, yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True))


# Tokens that give a mutated document tags, anchors, aliases, merge keys and odd nesting.
YAML_TOKENS = ["!!int ", "!!float ", "!!bool ", "!!timestamp ", "!!binary ", "!!set ", "!x ", "&a ", "*a", "<<: ", "? "]
YAML_TOKENS += ["[", "]", "{", "}", "- ", ": ", ", ", "\n", "\n  ", "'", '"', "#", "---\n", "%YAML 1.1\n", "\t"]


@settings(max_examples=150, deadline=None)
@given(
    doc=documents | shipped_config_variants(),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(YAML_TOKENS) | st.text(max_size=3)), max_size=6),
)
def test_edited_yaml_text_loads_or_is_a_qtool_error(config_file, doc, edits):
    text = yaml.safe_dump(doc)
    for position, insert in edits:
        position %= len(text) + 1
        text = text[:position] + insert + text[position:]
    _check(config_file, text)


@pytest.mark.parametrize("text", TRICKY_YAML, ids=range(len(TRICKY_YAML)))
def test_tricky_yaml_loads_or_is_a_qtool_error(config_file, text):
    _check(config_file, text)


def test_merge_keys_and_anchors_work_as_in_any_yaml_reader(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "global:\n  weight: &w {dtype: int4, granularity: per_block}\n"
        "op_type:\n  MatMul: {weight: {<<: *w, block_size: 64}}\n",
        encoding="utf-8",
    )
    config = qconfig.load_config(path)
    scheme = config.scheme_for("m", "MatMul")
    assert scheme is not None and scheme.weight.describe() == "int4 per_block(64) sym"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("version: !!int abc\n", ":1:10: cannot read 'abc' as !!int"),
        ("exclude: &a [*a]\n", "exclude.0: a YAML alias refers to a collection that contains it"),
        ("exclude: " + "[" * 2000 + "]" * 2000 + "\n", "YAML nests too deeply"),
        ("exclude: ['re:a{1001}']\n", "exclude.0: invalid regular expression"),
        ("exclude: ['re:(a)\\1']\n", "exclude.0: invalid regular expression"),  # RE2: no backreferences
    ],
)
def test_hostile_yaml_errors_say_where(tmp_path, text, where):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(QtoolError, match=r"c\.yaml") as error:
        qconfig.load_config(path)
    assert where in str(error.value)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=300))
def test_random_text_loads_or_is_a_qtool_error(config_file, text):
    _check(config_file, text)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_load_or_are_a_qtool_error(config_file, data):
    config_file.write_bytes(data)
    _load_and_use(config_file)


@pytest.mark.parametrize(
    "observer", ["{name: mse, candidates: .inf}", "{name: percentile, bins: 1099511627776}"], ids=["inf", "huge"]
)
def test_observer_options_that_overflow_or_allocate_without_bound_are_config_errors(tmp_path, observer):
    path = tmp_path / "c.yaml"
    path.write_text(f"calibration: {{observer: {observer}}}\n", encoding="utf-8")
    with pytest.raises(QtoolError, match=r"calibration\.observer"):
        qconfig.load_config(path)
