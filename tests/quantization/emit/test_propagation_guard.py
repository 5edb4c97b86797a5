"""A quantized tensor moved by a Transpose into an If body: onnxruntime's QDQ propagation aborted the process.

Silero VAD (openWakeWord's copy) has Conv -> Relu -> Transpose -> If, the Transpose's output read inside the
branches. With Q/DQ after the Relu, onnxruntime 1.32's QDQPropagationTransformer rewires an edge the If does not
have and aborts (SIGABRT, no Python exception). Both the quantize and the load run in subprocesses here, so
that the old behaviour fails the test instead of killing it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import INTEGER, run_model, save_checked

LOAD = "import onnxruntime as o, sys; o.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider']); print('ok')"


def _model(path: Path) -> Path:
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.standard_normal((8, 4, 3)).astype(np.float32) * 0.3, "w")
    then_branch = helper.make_graph(
        [helper.make_node("Identity", ["t"], ["a"], name="then_id")],
        "then",
        [],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [16, 1, 8])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["t"], ["b"], name="else_neg")],
        "else",
        [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [16, 1, 8])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1], name="conv"),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("Transpose", ["r"], ["t"], perm=[2, 0, 1], name="to_time_major"),
            helper.make_node("If", ["flag"], ["y"], then_branch=then_branch, else_branch=else_branch, name="branch"),
        ],
        "relu_transpose_if",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 1, 8])],
        [weight],
    )
    return save_checked(graph, path)


def test_a_transposed_quantized_tensor_read_in_a_body_loads_and_runs(tmp_path):
    model = _model(tmp_path / "m.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(4)
    for i in range(8):
        np.savez(data / f"{i:03d}.npz", x=rng.standard_normal((1, 4, 16)).astype(np.float32), flag=np.array(i % 2 == 0))
    out = tmp_path / "q.onnx"
    command = [sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(data), "-o", str(out)]
    quantized = subprocess.run([*command, "--config", str(INTEGER), "--no-search"], capture_output=True, text=True)
    assert quantized.returncode == 0, quantized.stdout + quantized.stderr
    load = subprocess.run([sys.executable, "-c", LOAD, str(out)], capture_output=True, text=True)
    assert load.returncode == 0 and load.stdout.strip() == "ok", load.stderr[-400:]
    nodes = {n.name: n for n in onnx.load(str(out)).graph.node}
    assert nodes["to_time_major"].input[0] == "r/float"  # the float value, not the dequantized one
    assert any(n.op_type == "QuantizeLinear" for n in nodes.values())  # the Conv is still an integer kernel
    feed = {"x": np.load(data / "000.npz")["x"], "flag": np.array(True)}
    reference, candidate = run_model(model, feed)[0], run_model(out, feed)[0]
    assert 10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - candidate) ** 2)) > 30
