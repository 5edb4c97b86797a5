from __future__ import annotations

from pathlib import Path

import pytest

from qtool.config import load_config
from qtool.errors import QtoolError
from qtool.schemas.config import NodeSettings

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_default_config_is_the_documented_int8_scheme():
    config = load_config()
    scheme = config.scheme_for("any", "Conv")
    assert scheme is not None
    assert (scheme.weight.dtype, scheme.weight.granularity, scheme.weight.symmetric) == ("int8", "per_channel", True)
    assert (scheme.activation.dtype, scheme.activation.granularity, scheme.activation.symmetric) == (
        "uint8",
        "per_tensor",
        False,
    )
    assert config.calibration.observer == "mse"


def test_configs_default_yaml_is_the_packaged_default():
    assert (ROOT / "configs" / "default.yaml").read_text() == (ROOT / "qtool" / "configs" / "default.yaml").read_text()


def test_partial_config_falls_back_to_defaults(tmp_path):
    config = load_config(write(tmp_path, "global: {activation: {dtype: int8}}\n"))
    scheme = config.scheme_for("n", "MatMul")
    assert scheme is not None
    assert scheme.activation.dtype == "int8" and scheme.activation.symmetric is False
    assert scheme.weight.granularity == "per_channel"


def test_precedence_node_name_over_op_type_over_global(tmp_path):
    config = load_config(
        write(
            tmp_path,
            """
op_type:
  Gemm: {weight: {granularity: per_tensor}}
  MatMul: null
node_name:
  "head/gemm": {weight: {symmetric: false}}
  "re:block[12]/.*": null
""",
        )
    )
    head = config.scheme_for("head/gemm", "Gemm")
    assert head is not None and head.weight.granularity == "per_tensor" and head.weight.symmetric is False
    assert config.scheme_for("fc", "MatMul") is None
    assert config.scheme_for("block1/conv", "Conv") is None
    assert config.scheme_for("block0/conv", "Conv") is not None


def test_exclude_list_keeps_nodes_in_float(tmp_path):
    config = load_config(write(tmp_path, "exclude: [a, 're:b.*']\n"))
    assert config.scheme_for("a", "Conv") is None and config.scheme_for("bx", "Conv") is None
    assert config.scheme_for("c", "Conv") is not None


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("global:\n  weight:\n    dtyp: int8\n", ":3:5:", "unknown key 'dtyp'"),
        ("global:\n  weight: {dtype: int3}\n", ":2:19:", "unsupported weight dtype 'int3'"),
        ("global:\n  activation: {granularity: per_channel}\n", ":2:29:", "only be quantized per_tensor"),
        ("calibration:\n  batch_size: 0\n", ":2:15:", "positive integer"),
        ("version: 7\n", ":1:10:", "unsupported config version"),
        ("global: [1, 2]\n", ":1:9:", "expected a mapping"),
        ("global: {weight: {symmetric: maybe}}\n", ":1:30:", "expected true or false"),
        ("node_name: {'re:(': null}\n", ":1:13:", "invalid regular expression"),
        ("global: {weight: [}\n", ":1:", "invalid YAML"),
        ("preprocess:\n  layout: CHW\n", ":2:11:", "expected one of NCHW, NHWC"),
        ("global:\n  activation: {dtype: int4}\n", ":2:23:", "unsupported activation dtype 'int4'"),
        ("global:\n  weight: {granularity: per_block, block_size: 1}\n", ":2:48:", "integer from 2 to"),
        ("op_type:\n  MatMul: {weight: {axis: x}}\n", ":2:27:", "expected an integer axis"),
        ("global:\n  weight_only: yes please\n", ":2:16:", "expected true or false"),
        ("global:\n  weight: {observer: minmax}\n", ":2:12:", "unknown key 'observer'"),
        ("node_name:\n  fc0/matmul: {activation: {observer: magic}}\n", ":2:39:", "unknown observer 'magic'"),
        ("global:\n  activation: {granularity: per_block}\n", ":2:29:", "only be quantized per_tensor"),
        ("preprocess:\n  mean: [1, 2]\n", ":2:9:", "list of 1 or 3 numbers"),
        ("calibration:\n  observer: {name: percentile, percentil: 9}\n", ":2:13:", "has no option 'percentil'"),
        ("calibration:\n  observer: magic\n", ":2:13:", "unknown observer 'magic'"),
    ],
)
def test_validation_errors_name_file_line_and_column(tmp_path, text, where, what):
    path = write(tmp_path, text)
    with pytest.raises(QtoolError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path) + where), message
    assert what in message


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(QtoolError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
        for i in range(1, 9)
    ]
    with pytest.raises(QtoolError, match="too large"):
        load_config(write(tmp_path, "\n".join(lines) + "\n"))


def test_observer_with_options_in_config(tmp_path):
    config = load_config(write(tmp_path, "calibration:\n  observer: {name: percentile, percentile: 99.9}\n"))
    assert config.calibration.observer == "percentile"
    assert config.calibration.observer_options == {"percentile": 99.9}


def test_a_node_name_rule_beats_an_op_type_null(tmp_path):
    config = load_config(write(tmp_path, "op_type: {Conv: null}\nnode_name: {block1/conv: {weight: {dtype: int4}}}\n"))
    scheme, rule = config.resolve("block1/conv", "Conv")
    assert scheme is not None and scheme.weight.dtype == "int4" and rule == "node_name:block1/conv"
    assert config.resolve("block0/conv", "Conv") == (None, "op_type:Conv")


@pytest.mark.parametrize("text", ["op_type: 5\n", "node_name: [{x: null}]\n"])
def test_sections_of_the_wrong_type_are_config_errors(tmp_path, text):
    with pytest.raises(QtoolError, match="expected a mapping"):
        load_config(write(tmp_path, text))


def test_every_key_of_the_default_config_is_described_and_defaulted_in_the_schema():
    import yaml

    from qtool.schemas import json_schema

    schema = json_schema("config")
    defs = schema["$defs"]
    default = yaml.safe_load((Path(__file__).parents[2] / "configs" / "default.yaml").read_text())
    where = {
        "": (schema["properties"], default),
        "NodeSettings": (defs["NodeSettings"]["properties"], default["global"]),
        "WeightSettings": (defs["WeightSettings"]["properties"], default["global"]["weight"]),
        "ActivationSettings": (defs["ActivationSettings"]["properties"], default["global"]["activation"]),
        "AlgorithmSettings": (defs["AlgorithmSettings"]["properties"], default["global"]["algorithms"]),
        "CalibrationSection": (defs["CalibrationSection"]["properties"], default["calibration"]),
        "AccuracySection": (defs["AccuracySection"]["properties"], default["accuracy"]),
    }
    for name, (properties, values) in where.items():
        assert set(values) <= set(properties), name  # the default file has no key the schema lacks
        for key, prop in properties.items():
            assert prop.get("description"), f"{name}.{key} has no description"
            if key in values and not isinstance(values[key], dict):
                assert prop["default"] == values[key], f"{name}.{key}"
    assert set(defs["NodeSettings"]["properties"]) == set(default["global"])  # every setting has a default


def test_the_validated_document_is_what_runs():
    config = load_config({"global": {"algorithms": {"smoothquant_alpha": 1}}, "accuracy": {"search_seconds": 5}})
    assert config.global_scheme.algorithms.smoothquant_alpha == 1.0 and isinstance(
        config.global_scheme.algorithms.smoothquant_alpha, float
    )
    assert config.accuracy.search_seconds == 5.0
    assert config.global_scheme.algorithms.rounding == "nearest"  # from the default file


def test_a_null_block_size_means_the_default_block_size():
    config = load_config({"global": {"weight": {"granularity": "per_block", "block_size": None}}})
    assert config.global_scheme.weight.block_size == 32


def test_candidate_configs_are_built_as_objects_and_resolve_like_a_loaded_file():
    base = load_config()
    built = base.with_rules(
        op_type={"Conv": None}, node_name={"a": NodeSettings.model_validate({"weight": {"dtype": "int4"}})}
    )
    loaded = load_config({"op_type": {"Conv": None}, "node_name": {"a": {"weight": {"dtype": "int4"}}}})
    for name, op in (("a", "Conv"), ("b", "Conv"), ("c", "MatMul")):
        assert built.resolve(name, op) == loaded.resolve(name, op)
    assert base.with_rules(global_={"weight": {"dtype": "int4"}}).global_scheme.weight.dtype == "int4"
