"""fp8 in the QConfigDict: what it accepts, what it refuses (at the YAML line), and what each target makes of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from qtool.config import load_config
from qtool.errors import QtoolError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_fp8_weights_and_activations_are_symmetric_whatever_the_default_says(tmp_path):
    dtype = "fp8_e4m3"
    config = load_config(write(tmp_path, f"global:\n  weight: {{dtype: {dtype}}}\n  activation: {{dtype: {dtype}}}\n"))
    scheme = config.global_scheme
    assert scheme.weight.dtype == scheme.activation.dtype == dtype
    assert scheme.weight.fp8 and scheme.activation.fp8
    assert scheme.activation.symmetric  # the built-in default's activation.symmetric is false
    assert scheme.weight.granularity == "per_channel"
    assert config.opset_requirement() == (19, f"{dtype} weights")
    assert config.quantized_dtypes() == (frozenset({dtype}), frozenset({dtype}))


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        (
            "global:\n  activation:\n    dtype: fp8_e4m3\n    symmetric: false\n",
            ":4:16: global.activation.symmetric:",
            "rule global asks for fp8_e4m3 activations, which are symmetric only",
        ),
        (
            "global:\n  weight: {dtype: fp8_e4m3, granularity: per_block}\n",
            ":2:42: global.weight.granularity:",
            "which are per_tensor or per_channel",
        ),
        (  # the rule's fp8 meets a setting it takes from global: the error points at that setting, naming the rule
            "global:\n  weight: {dtype: int4, granularity: per_block}\n"
            "op_type:\n  MatMul: {weight: {dtype: fp8_e4m3}}\n",
            ":2:38: global.weight.granularity:",
            "rule op_type:MatMul asks for fp8_e4m3 weights",
        ),
        (
            "node_name:\n  fc1/matmul:\n    activation: {dtype: fp8_e4m3, symmetric: false}\n",
            ":3:46: node_name.fc1/matmul.activation.symmetric:",
            "rule node_name:fc1/matmul asks for fp8_e4m3 activations",
        ),
        (
            "global:\n  weight: {dtype: fp8_e4m3, format: matmul_nbits}\n",
            ":2:37: global.weight.format:",
            "which are stored as QDQ",
        ),
        ("global:\n  activation: {dtype: float8e4m3fn}\n", ":2:23:", "unsupported activation dtype 'float8e4m3fn'"),
        # qparams has E5M2, but onnxruntime 1.32's CPU optimizer computes E5M2 Q/DQ models wrongly
        ("global:\n  weight: {dtype: fp8_e5m2}\n", ":2:19:", "unsupported weight dtype 'fp8_e5m2'"),
    ],
)
def test_fp8_settings_that_cannot_be_are_refused_at_their_yaml_line(tmp_path, text, where, what):
    path = write(tmp_path, text)
    with pytest.raises(QtoolError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path) + where), message
    assert what in message and "\n" not in message


def test_an_int8_rule_under_an_fp8_global_keeps_its_own_settings(tmp_path):
    text = (
        "global:\n  weight: {dtype: fp8_e4m3}\n  activation: {dtype: fp8_e4m3}\n"
        "op_type:\n  MatMul: {weight: {dtype: int8, symmetric: false}, activation: {dtype: uint8}}\n"
    )
    config = load_config(write(tmp_path, text))
    scheme = config.scheme_for("fc", "MatMul")
    assert scheme is not None and scheme.weight.dtype == "int8" and not scheme.weight.symmetric
    assert scheme.activation.dtype == "uint8" and not scheme.activation.symmetric


def test_tensorrt_keeps_fp8_e4m3_activations_and_weights(tmp_path):
    text = "target: tensorrt\nglobal:\n  weight: {dtype: fp8_e4m3}\n  activation: {dtype: fp8_e4m3}\n"
    config = load_config(write(tmp_path, text))
    scheme = config.scheme_for("conv", "Conv")
    assert scheme is not None
    assert (scheme.weight.dtype, scheme.activation.dtype) == ("fp8_e4m3", "fp8_e4m3")
    assert scheme.activation.symmetric and scheme.placement == "integer"
    cuda = config.with_target("cuda").scheme_for("conv", "Conv")
    assert cuda is not None and cuda.placement == "storage" and cuda.weight.dtype == "fp8_e4m3"


def test_the_packaged_fp8_config_is_tensorrt_e4m3_per_channel_weights_per_tensor_activations():
    config = load_config("fp8")
    assert config.target == "tensorrt"
    scheme = config.scheme_for("conv", "Conv")
    assert scheme is not None
    assert scheme.weight.describe() == "fp8_e4m3 per_channel sym"
    assert scheme.activation.describe() == "fp8_e4m3 per_tensor sym"
    assert (ROOT / "configs" / "fp8.yaml").resolve() == (ROOT / "qtool" / "configs" / "fp8.yaml")


@pytest.mark.parametrize("spelling", ["float8e4m3fn", "FLOAT8E4M3FN", "fp8", "float8_e5m2", "e4m3"])
def test_other_names_for_float8_are_pointed_to_fp8_e4m3(tmp_path, spelling):
    with pytest.raises(QtoolError) as info:
        load_config(write(tmp_path, f"global:\n  weight: {{dtype: {spelling}}}\n"))
    assert info.value.hint is not None and "write fp8_e4m3 for ONNX's FLOAT8E4M3FN" in info.value.hint
    with pytest.raises(QtoolError) as other:
        load_config(write(tmp_path, "global:\n  weight: {dtype: int3}\n"))
    assert other.value.hint is not None and "FLOAT8" not in other.value.hint
