"""onnxruntime sessions: quiet options, and failures turned into QtoolError."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool.errors import QtoolError
from qtool.graph.ort_rewrites import unsafe_rewrites
from qtool.graph.weights import Weights, is_detached

Feed = dict[str, np.ndarray]  # a model's inputs by name, as a session takes them

_SOURCE_LOCATION = re.compile(r"^\S+\.(?:cc|cpp|h):\d+ ")


def _first_line(error: Exception) -> str:
    """The message's first line; with the next one when it ends in a colon (what it announces is there)."""
    lines = [line.strip() for line in runtime_message(str(error)).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def runtime_message(text: str) -> str:
    """Onnxruntime's error text without the C++ source location and function signature it starts with."""
    text = text.strip()
    location = _SOURCE_LOCATION.match(text)
    if location is None:
        return text
    start, depth = text.find("(", location.end()), 0
    if start < 0:
        return text
    for i in range(start, len(text)):  # the message follows the signature's closing parenthesis
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[i + 1 :].strip() or text
    return text


def inference_session(
    source: str | bytes,
    options: ort.SessionOptions | None = None,
    providers: list[str | tuple[str, dict[str, str]]] | None = None,
    disabled: list[str] | None = None,
) -> ort.InferenceSession:
    """``ort.InferenceSession`` without onnxruntime's silent provider fallback.

    When a provider fails to start (TensorRT without its libraries), onnxruntime would print an
    "EP Error" notice to stdout (where it corrupts ``--json -``) and retry with other providers, at
    creation and again at run time. Here the failure is raised instead, with the provider's reason.
    """
    return ort.InferenceSession(
        source,
        options,
        providers=providers or ["CPUExecutionProvider"],
        disabled_optimizers=disabled,
        enable_fallback=0,
    )


_shared_arena: bool | None = None  # None: not tried yet


def _use_shared_arena() -> bool:
    """Register one CPU arena for all of qtool's sessions (once per process); False if onnxruntime refuses.

    Each session would otherwise keep its own arena at its peak activation size: qtool holds
    several sessions at once (candidates timed interleaved), and runs them one at a time, so
    one arena sized for the largest run serves them all.
    """
    global _shared_arena
    if _shared_arena is None:
        try:
            memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, -1, -1, -1))
            _shared_arena = True
        except Exception:  # noqa: BLE001 - an onnxruntime without it: every session keeps its own arena
            _shared_arena = False
    return _shared_arena


def session_options(
    *,
    threads: int | None = None,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    spinning: bool = True,
) -> ort.SessionOptions:
    """Quiet, deterministic onnxruntime session options, sharing one CPU memory arena.

    ``spinning=False`` makes onnxruntime's worker threads sleep between runs instead of busy-waiting
    for the next one, so that work done between runs (observing activations) has the cores.
    """
    options = ort.SessionOptions()
    # fatal only: onnxruntime logs a failed run (a token id past the vocabulary, a wrong shape) as a raw, coloured
    # line before raising it, and qtool reports the raised error itself, naming the sample
    options.log_severity_level = 4
    options.graph_optimization_level = level
    if threads:
        options.intra_op_num_threads = threads
    if _use_shared_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


_ORT_TYPES = {"tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(float16)": np.float16}


def typed_empties(session: ort.InferenceSession, feed: Feed) -> Feed:
    """``feed`` with each empty input in the type the session expects (a float or an int8 key/value cache)."""
    expected = {i.name: _ORT_TYPES.get(i.type) for i in session.get_inputs()}
    return {
        name: value.astype(dtype) if value.size == 0 and (dtype := expected.get(name)) is not None else value
        for name, value in feed.items()
    }


def create_session(
    model: onnx.ModelProto | str | Path,
    what: str,
    *,
    threads: int | None = None,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    providers: list[str | tuple[str, dict[str, str]]] | None = None,
    weights: Weights | None = None,
    spinning: bool = True,
) -> ort.InferenceSession:
    """An onnxruntime CPU session, with a QtoolError naming ``what`` if onnxruntime refuses the model.

    A ModelProto's detached initializers (see :mod:`qtool.graph.weights`) take their values from ``weights``.
    ``spinning``: see :func:`session_options`. onnxruntime rewrites that would change what the model
    computes are turned off (see :mod:`qtool.graph.ort_rewrites`).
    """
    unsafe = unsafe_rewrites(model)
    if isinstance(model, (str, Path)):
        options = session_options(threads=threads, level=level, spinning=spinning)
        return _session(str(model), options, providers, what, disabled=unsafe or None)
    source = model.SerializeToString()
    store = weights or Weights()
    options = session_options(threads=threads, level=level, spinning=spinning)
    folds = _folds_detached(model)
    shared = store.session_options(model, options, copy=folds)
    if not shared:
        return _session(source, options, providers, what, disabled=unsafe or None)
    if folds:  # onnxruntime gets copies, and folds what only folding runs
        session = _session(source, options, providers, what, disabled=unsafe or None)
        session._qtool_initializers = shared
        return session
    # onnxruntime reads shared arrays in place, but its constant folding would try to read them from
    # the placeholder location: it is turned off, and a model that still needs them read gets copies.
    options.log_severity_level = 4  # a refusal here is expected and handled: not an error to show
    try:
        session = _session(source, options, providers, what, disabled=["ConstantFolding", *unsafe])
    except QtoolError:
        options = session_options(threads=threads, level=level, spinning=spinning)
        shared = store.session_options(model, options, copy=True)
        session = _session(source, options, providers, what, disabled=unsafe or None)
    session._qtool_initializers = shared  # onnxruntime reads these arrays: they live as long as the session
    return session


def _folds_detached(model: onnx.ModelProto) -> bool:
    """Whether the model computes something from a detached initializer alone that only constant folding runs.

    A DINOv2 export resizes its position embeddings with a cubic Resize to scales below 1 that onnxruntime's kernel
    refuses at run time, but folds when the session starts: such a model gets copies of the values (folding on).
    Ops that only move or convert values run the same unfolded (a tied embedding's Transpose for the output
    projection, say): a model whose computations on detached values are only those keeps sharing them.
    """
    constants = {init.name for init in model.graph.initializer}
    from_detached = {init.name for init in model.graph.initializer if is_detached(init)}
    for node in model.graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type in ("Shape", "Size"):  # a shape onnxruntime knows when the session starts, say
            constants.update(node.output)
        elif inputs and all(name in constants for name in inputs):
            if from_detached & set(inputs):
                if node.op_type not in _RUN_UNFOLDED:
                    return True
                from_detached.update(node.output)
            constants.update(node.output)
    return False


# Ops whose kernels take whatever constant input they get: run unfolded, they compute what folding would.
_RUN_UNFOLDED = frozenset(
    {"Identity", "Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Slice", "Gather"}
)


def _session(
    source: str | bytes,
    options: ort.SessionOptions,
    providers: list[str | tuple[str, dict[str, str]]] | None,
    what: str,
    disabled: list[str] | None = None,
) -> ort.InferenceSession:
    try:
        return inference_session(source, options, providers, disabled)
    except Exception as e:  # onnxruntime raises its own untyped exception family
        _raise_if_ir_too_new(e, what)
        raise QtoolError(f"onnxruntime cannot load {what}: {_first_line(e)}") from e


_IR_VERSION_ERROR = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def _raise_if_ir_too_new(error: Exception, what: str) -> None:
    """Turn onnxruntime's refusal of a newer IR version into a QtoolError naming both versions."""
    versions = _IR_VERSION_ERROR.search(str(error))
    if versions:
        raise QtoolError(
            f"{what} has ONNX IR version {versions[1]}, newer than onnxruntime {ort.__version__} loads "
            f"(IR version {versions[2]} at most)",
            hint="upgrade onnxruntime, or export the model with an older onnx",
        ) from error


def check_runtime_support(model: onnx.ModelProto, source: str, opset: int) -> None:
    """Fail early, naming ``source``, when onnxruntime cannot load this IR version at ``opset``.

    ``opset`` is the one the model will be converted to (see :mod:`qtool.graph.opsets`). A one-node model
    with the same IR version and opset is all it takes to ask.

    Raises:
        QtoolError: naming the versions onnxruntime refused.
    """
    probe = helper.make_model(
        helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        ),
        opset_imports=[helper.make_opsetid("", opset)],
        ir_version=model.ir_version,
    )
    try:
        ort.InferenceSession(probe.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own untyped exception family
        _raise_if_ir_too_new(e, source)
        raise QtoolError(
            f"onnxruntime {ort.__version__} cannot load {source} (IR version {model.ir_version}, opset {opset}): "
            f"{_first_line(e)}",
            hint="upgrade onnxruntime, or export the model with an older opset",
        ) from e


def run_session(session: ort.InferenceSession, names: list[str] | None, feed: Feed, what: str) -> list[Any]:
    """``session.run`` with onnxruntime's failures turned into a QtoolError naming ``what``.

    An empty input (a decoder's cache before the first token) takes the type the session expects:
    the same empty prefill then feeds a float cache and an int8 one. No names (a model whose outputs are all
    integers, say, has no float output to compare) run nothing: onnxruntime would return every output.
    """
    if names is not None and not names:
        return []
    if any(value.size == 0 for value in feed.values()):
        feed = typed_empties(session, feed)
    try:
        return session.run(names, feed)
    except Exception as e:
        raise QtoolError(f"onnxruntime failed running {what}: {_first_line(e)}") from e
