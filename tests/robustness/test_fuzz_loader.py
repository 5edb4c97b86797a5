"""Damaged and hostile models: loading, inspecting and quantizing them works or is a QtoolError, nothing else.

A bounded, seeded fuzz run over mutated copies of the sample models (bytes flipped, cut, repeated,
and protobuf fields set to values no exporter writes), plus named structured mutations. Memory stays
bounded: the address space is capped while the mutants run, so a tensor that claims 2**40 x 2**40
values and gets allocated fails the test instead of swapping the machine.
"""

from __future__ import annotations

import contextlib
import resource
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import qtool
from qtool.cli import app
from qtool.errors import QtoolError
from qtool.graph.model_io import load_model
from tests.conftest import SAMPLE_NAMES, calib_dir, sample

SEED = 20261122
MUTANTS_PER_SAMPLE = 60  # 180 in all, about two seconds
HEADROOM = 2 << 30  # address space the code under test may add while mutants run

runner = CliRunner()


@contextlib.contextmanager
def bounded_memory(headroom: int = HEADROOM) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``headroom`` (Linux), restoring it afterwards."""
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        yield  # not Linux: run without the cap
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = current + headroom if hard == resource.RLIM_INFINITY else min(hard, current + headroom)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _outcome(action: Callable[[], object]) -> tuple[bool, str | None]:
    """Whether ``action`` worked, and what went wrong when it raised anything but a QtoolError."""
    try:
        action()
    except QtoolError as e:
        assert str(e).strip(), "a QtoolError must say what went wrong"
        return False, None
    except Exception as e:  # noqa: BLE001 - the property under test: nothing but QtoolError may escape
        frames = traceback.extract_tb(e.__traceback__)[-4:]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
        return False, f"{type(e).__name__}: {str(e)[:200]} [{where}]"
    return True, None


def _quantize(model: Path, out: Path, name: str) -> None:
    try:
        qtool.quantize(model, out, data_dir=calib_dir(name), search=None, evaluation=None)
    except QtoolError:
        assert not out.exists(), "a failed quantize must not leave its output behind"
        raise
    onnx.checker.check_model(onnx.load(str(out)))


# ------------------------------------------------------------------ random mutations
def _mutate_bytes(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    out = bytearray(data)
    kind = int(rng.integers(5))
    if kind == 0:
        flips = int(rng.integers(1, 17))
        for _ in range(flips):
            out[int(rng.integers(len(out)))] ^= 1 << int(rng.integers(8))
        return bytes(out), f"{flips} bit flips"
    if kind == 1:
        end = int(rng.integers(1, len(out)))
        return bytes(out[:end]), f"truncated to {end} bytes"
    start = int(rng.integers(len(out)))
    length = int(rng.integers(1, 4096))
    at = int(rng.integers(len(out)))
    if kind == 2:
        out[at:at] = out[start : start + length]
        return bytes(out), f"bytes {start}+{length} repeated at {at}"
    if kind == 3:
        out[at : at + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        return bytes(out), f"{length} random bytes at {at}"
    del out[start : start + length]
    return bytes(out), f"bytes {start}+{length} deleted"


def _random_field(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    """Set one field of a decoded model to a value no exporter writes; returns what it did."""
    graph = model.graph
    tensor = graph.initializer[int(rng.integers(len(graph.initializer)))]
    node = graph.node[int(rng.integers(len(graph.node)))]
    kind = int(rng.integers(8))
    if kind == 0:
        dims = [int(d) for d in rng.choice([0, 1, 3, -1, 2**31, 2**40, 2**62], size=int(rng.integers(0, 4)))]
        del tensor.dims[:]
        tensor.dims.extend(dims)
        return f"initializer {tensor.name} dims -> {dims}"
    if kind == 1:
        data_type = int(rng.choice([0, 2, 3, 7, 8, 10, 11, 16, 22, 26, 99]))
        tensor.data_type = data_type
        return f"initializer {tensor.name} data_type -> {data_type}"
    if kind == 2:
        position = int(rng.integers(len(node.input))) if node.input else 0
        if node.input:
            node.input[position] = "missing_tensor"
        return f"node {node.name} input {position} -> missing_tensor"
    if kind == 3:
        del graph.node[int(rng.integers(len(graph.node)))]
        return "one node deleted"
    if kind == 4:
        nodes = list(graph.node)
        order = rng.permutation(len(nodes))
        del graph.node[:]
        graph.node.extend(nodes[i] for i in order)
        return "nodes shuffled"
    if kind == 5:
        # Not Conv, MatMul or Gemm: a one-input node of those types is a known bug, see rank1_conv_weight's neighbours.
        node.op_type = str(rng.choice(["Relu", "Identity", "Sigmoid", "NoSuchOp"]))
        return f"node {node.name} op_type -> {node.op_type}"
    if kind == 6:
        value = graph.input[0].type.tensor_type
        value.elem_type = int(rng.choice([0, 1, 7, 10]))
        return f"input elem_type -> {value.elem_type}"
    model.opset_import[0].version = int(rng.choice([1, 7, 12, 21, 25, 1000]))
    return f"opset -> {model.opset_import[0].version}"


def _mutants(name: str) -> Iterator[tuple[int, bytes, str]]:
    original = sample(name).read_bytes()
    rng = np.random.default_rng([SEED, SAMPLE_NAMES.index(name)])
    for index in range(MUTANTS_PER_SAMPLE):
        if index % 2 == 0:
            data, what = _mutate_bytes(original, rng)
        else:
            model = onnx.load_from_string(original)
            what = _random_field(model, rng)
            data = model.SerializeToString()
        yield index, data, what


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_mutated_sample_models_load_and_inspect_or_fail_cleanly(tmp_path, name):
    """Quantizing (calibration included) is left to the named mutations below: it costs a hundred times more."""
    failures: list[str] = []
    accepted = 0
    path = tmp_path / "mutant.onnx"
    with bounded_memory():
        for index, data, what in _mutants(name):
            path.write_bytes(data)
            loaded, load_problem = _outcome(lambda: load_model(path))
            inspected, inspect_problem = _outcome(lambda: qtool.inspect(path))
            accepted += inspected
            if inspected and not loaded:
                inspect_problem = "inspect took what load_model refused"
            label = f"seed {SEED}, {name} mutant {index} ({what})"
            failures += [f"{label}: {problem}" for problem in (load_problem, inspect_problem) if problem]
    assert not failures, "\n".join(failures)
    assert 0 < accepted < MUTANTS_PER_SAMPLE, "the mutations should neither all pass nor all be refused"


# ------------------------------------------------------------------ named structured mutations
def _weight(model: onnx.ModelProto) -> TensorProto:
    """The weight initializer of the first Conv / Gemm / MatMul."""
    node = next(n for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul"))
    return next(t for t in model.graph.initializer if t.name == node.input[1])


def _set_dims(tensor: TensorProto, dims: list[int]) -> None:
    del tensor.dims[:]
    tensor.dims.extend(dims)


def absurd_dims(m: onnx.ModelProto) -> None:
    t = _weight(m)
    _set_dims(t, [2**40, 2**40])
    t.raw_data = bytes(16)


def absurd_dims_typed_data(m: onnx.ModelProto) -> None:
    t = _weight(m)
    _set_dims(t, [2**40, 2**40])
    t.ClearField("raw_data")
    t.float_data.extend([1.0, 2.0])


def dims_overflowing_int64(m: onnx.ModelProto) -> None:
    t = _weight(m)
    _set_dims(t, [2**62, 2**62, 2**62])
    t.raw_data = bytes(16)


def negative_dims(m: onnx.ModelProto) -> None:
    t = _weight(m)
    _set_dims(t, [-t.dims[0], *t.dims[1:]])


def too_much_data(m: onnx.ModelProto) -> None:
    _weight(m).raw_data += bytes(64)


def too_little_data(m: onnx.ModelProto) -> None:
    t = _weight(m)
    t.raw_data = t.raw_data[:-4]


def wrong_data_type(m: onnx.ModelProto) -> None:
    _weight(m).data_type = TensorProto.DOUBLE


def undefined_data_type(m: onnx.ModelProto) -> None:
    _weight(m).data_type = TensorProto.UNDEFINED


def unknown_data_type(m: onnx.ModelProto) -> None:
    _weight(m).data_type = 999


def string_data_type(m: onnx.ModelProto) -> None:
    _weight(m).data_type = TensorProto.STRING


def int4_weight(m: onnx.ModelProto) -> None:
    _weight(m).data_type = TensorProto.INT4  # the bytes now hold twice as many 4-bit values as the dims claim


def missing_node_input(m: onnx.ModelProto) -> None:
    m.graph.node[1].input[0] = "no_such_tensor"


def missing_weight(m: onnx.ModelProto) -> None:
    next(n for n in m.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")).input[1] = "no_such_weight"


def empty_graph(m: onnx.ModelProto) -> None:
    del m.graph.node[:]


def no_graph_outputs(m: onnx.ModelProto) -> None:
    del m.graph.output[:]


def duplicate_tensor_producers(m: onnx.ModelProto) -> None:
    m.graph.node[1].output[0] = m.graph.node[0].output[0]


def duplicate_node_names(m: onnx.ModelProto) -> None:
    for node in m.graph.node:
        node.name = "same"


def opset_too_new(m: onnx.ModelProto) -> None:
    m.opset_import[0].version = 1000


def opset_zero(m: onnx.ModelProto) -> None:
    m.opset_import[0].version = 0


def ir_version_too_new(m: onnx.ModelProto) -> None:
    m.ir_version = 10**6


def nan_weight(m: onnx.ModelProto) -> None:
    t = _weight(m)
    values = numpy_helper.to_array(t).copy()
    values.flat[0] = np.nan
    t.CopyFrom(numpy_helper.from_array(values, t.name))


def absurd_input_dims(m: onnx.ModelProto) -> None:
    for dim in m.graph.input[0].type.tensor_type.shape.dim:
        dim.dim_value = 2**40


def integer_input(m: onnx.ModelProto) -> None:
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64


def initializer_named_like_the_input(m: onnx.ModelProto) -> None:
    t = TensorProto()
    t.CopyFrom(_weight(m))
    t.name = m.graph.input[0].name
    m.graph.initializer.append(t)


def external_data_with_bad_offset(m: onnx.ModelProto) -> None:
    t = _weight(m)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="weights.bin")
    t.external_data.add(key="offset", value="not a number")


def empty_if_branches(m: onnx.ModelProto) -> None:
    empty = helper.make_graph([], "branch", [], [])
    m.graph.node.append(helper.make_node("If", ["cond"], ["unused"], then_branch=empty, else_branch=empty))


def zero_sized_weight(m: onnx.ModelProto) -> None:
    t = _weight(m)
    _set_dims(t, [0, *t.dims[1:]])
    t.raw_data = b""


def rank1_conv_weight(m: onnx.ModelProto) -> None:
    t = _weight(m)
    _set_dims(t, [int(np.prod(t.dims))])


def batchnorm_epsilon_of_the_wrong_type(m: onnx.ModelProto) -> None:
    bn = next(n for n in m.graph.node if n.op_type == "BatchNormalization")
    bn.attribute.append(helper.make_attribute("epsilon", "tiny"))


def cycle(m: onnx.ModelProto) -> None:
    m.graph.node[0].input[0] = m.graph.node[1].output[0]


def unknown_op(m: onnx.ModelProto) -> None:
    m.graph.node[0].op_type = "NoSuchOp"


def no_graph_inputs(m: onnx.ModelProto) -> None:
    del m.graph.input[:]


def duplicate_initializer(m: onnx.ModelProto) -> None:
    m.graph.initializer.append(_weight(m))


def conv_without_a_weight_input(m: onnx.ModelProto) -> None:
    relu = next(n for n in m.graph.node if n.op_type == "Relu")
    relu.op_type = "Conv"


STRUCTURED = [
    *(
        pytest.param(mutation, "cnn", id=mutation.__name__)
        for mutation in (
            absurd_dims,
            absurd_dims_typed_data,
            dims_overflowing_int64,
            negative_dims,
            too_much_data,
            too_little_data,
            wrong_data_type,
            undefined_data_type,
            unknown_data_type,
            string_data_type,
            int4_weight,
            missing_node_input,
            missing_weight,
            empty_graph,
            no_graph_outputs,
            duplicate_tensor_producers,
            duplicate_node_names,
            opset_too_new,
            opset_zero,
            ir_version_too_new,
            nan_weight,
            absurd_input_dims,
            integer_input,
            initializer_named_like_the_input,
            external_data_with_bad_offset,
            empty_if_branches,
        )
    ),
    pytest.param(absurd_dims, "mlp", id="absurd_dims-mlp"),
    pytest.param(too_much_data, "transformer", id="too_much_data-transformer"),
    pytest.param(
        zero_sized_weight,
        "cnn",
        id="zero_sized_weight",
    ),
    pytest.param(
        zero_sized_weight,
        "mlp",
        id="zero_sized_weight-mlp",
    ),
    pytest.param(
        rank1_conv_weight,
        "cnn",
        id="rank1_conv_weight",
    ),
    pytest.param(
        batchnorm_epsilon_of_the_wrong_type,
        "cnn",
        id="batchnorm_epsilon_of_the_wrong_type",
    ),
    pytest.param(
        cycle,
        "cnn",
        id="cycle",
    ),
    pytest.param(
        unknown_op,
        "cnn",
        id="unknown_op",
    ),
    pytest.param(
        no_graph_inputs,
        "cnn",
        id="no_graph_inputs",
    ),
    pytest.param(
        conv_without_a_weight_input,
        "cnn",
        id="conv_without_a_weight_input",
    ),
    pytest.param(
        duplicate_initializer,
        "mlp",
        id="duplicate_initializer-mlp",
    ),
]


@pytest.mark.parametrize(("mutation", "name"), STRUCTURED)
def test_structured_mutation_is_handled_or_a_qtool_error(tmp_path, mutation, name):
    model = onnx.load(str(sample(name)))
    mutation(model)
    path, out = tmp_path / "model.onnx", tmp_path / "model.int8.onnx"
    path.write_bytes(model.SerializeToString())
    (tmp_path / "weights.bin").write_bytes(bytes(1 << 20))
    with bounded_memory():
        outcomes = [_outcome(lambda: load_model(path)), _outcome(lambda: qtool.inspect(path))]
        outcomes.append(_outcome(lambda: _quantize(path, out, name)))
    problems = [problem for _, problem in outcomes if problem]
    assert not problems, f"{mutation.__name__} on {name}:\n" + "\n".join(problems)


def test_text_that_is_not_utf8_is_a_clear_error(tmp_path):
    model = onnx.load(str(sample("cnn")))
    data = model.SerializeToString().replace(b"block0/relu", b"block0/rel\xff", 1)
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    with pytest.raises(QtoolError, match="not UTF-8"):
        load_model(path)


@pytest.mark.parametrize("mutation", [absurd_dims, absurd_dims_typed_data, dims_overflowing_int64])
def test_absurd_tensor_size_claim_is_a_clear_error(tmp_path, mutation):
    model = onnx.load(str(sample("cnn")))
    mutation(model)
    path, out = tmp_path / "huge.onnx", tmp_path / "huge.int8.onnx"
    path.write_bytes(model.SerializeToString())
    assert path.stat().st_size < 400_000  # the claim is in the dims, not in the bytes
    with bounded_memory(1 << 30):
        with pytest.raises(QtoolError, match=r"tensor 'block0\.conv\.weight' .* does not hold the data"):
            qtool.quantize(path, out, data_dir=calib_dir("cnn"), evaluation=None)
        r = runner.invoke(app, ["quantize", str(path), "--data", str(calib_dir("cnn")), "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert "block0.conv.weight" in r.stderr and str(path) in r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) <= 3
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["huge.onnx"]
