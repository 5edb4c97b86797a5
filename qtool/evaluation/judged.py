"""Which outputs an accuracy target judges: the ones named, or every output but the state a model feeds back.

A streaming model (a voice-activity detector, an RNN run chunk by chunk) returns its answer and the
state its next call takes as an input. Quantization noise in that state is not what the user ships: its
effect shows in the answer of the chunks after. So without ``accuracy.outputs`` (or ``--outputs``), an
output whose name and shape pair with an input's (``state`` -> ``stateN``, ``h0`` -> ``hn``,
``hidden_in`` -> ``hidden_out``) is reported but does not decide the target. A decoder's key/value cache
is its own case (:mod:`qtool.calibration.decoder`): it is judged as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from qtool.calibration.decoder import model_decoder
from qtool.errors import QtoolError

# name parts that mark one step of a state: what is left of both names must be the same
_STEP_WORDS = ("input", "output", "in", "out", "prev", "next", "new", "old", "past", "present", "n", "0", "1", "t")


@dataclass(frozen=True)
class JudgedOutputs:
    """The outputs a target judges, and the ones left out with why."""

    judged: tuple[str, ...]
    state: dict[str, str]  # output -> the input it feeds back (recognised, not judged)
    named: bool  # the user named the judged outputs

    @property
    def subset(self) -> frozenset[str] | None:
        """The judged outputs when they are not all of them (None: every output)."""
        return frozenset(self.judged) if self.state or self.named else None

    def note(self) -> str:
        """What the target judges, in words (empty when it is every output as usual)."""
        if self.named:
            return f"the target judges the outputs named: {', '.join(self.judged)}"
        if not self.state:
            return ""
        fed = ", ".join(f"{out} (fed back as {inp})" for out, inp in sorted(self.state.items()))
        return (
            f"the target judges {', '.join(self.judged)}; state outputs are reported, not judged: {fed} "
            "(name the judged outputs with accuracy.outputs or --outputs)"
        )


def judged_outputs(model: onnx.ModelProto, patterns: Sequence[str] = (), source: str = "--outputs") -> JudgedOutputs:
    """The outputs of ``model`` a target judges: those ``patterns`` name (exact or ``re:``), else all but the state.

    Raises:
        QtoolError: a pattern names no output of the model.
    """
    outputs = [o.name for o in model.graph.output]
    if patterns:
        named: list[str] = []
        for pattern in patterns:
            found = [name for name in outputs if _matches(pattern, name)]
            if not found:
                raise QtoolError(
                    f"{source}: '{pattern}' names no output of the model",
                    hint=f"its outputs are: {', '.join(outputs)}",
                )
            named += [name for name in found if name not in named]
        return JudgedOutputs(tuple(named), {}, named=True)
    if model_decoder(model) is not None:
        return JudgedOutputs(tuple(outputs), {}, named=False)
    state = _state_outputs(model)
    judged = tuple(name for name in outputs if name not in state)
    if not judged:  # every output is state: nothing else to judge by
        return JudgedOutputs(tuple(outputs), {}, named=False)
    return JudgedOutputs(judged, state, named=False)


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(pattern[3:], name) is not None if pattern.startswith("re:") else pattern == name


def _state_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Outputs whose name and shape pair with an input's: output -> input."""
    inputs = {v.name: v for v in model.graph.input}
    found = {}
    for output in model.graph.output:
        stem = _stem(output.name)
        if not stem:
            continue
        for name, value in inputs.items():
            if name != output.name and _stem(name) == stem and _same_shape(value, output):
                found[output.name] = name
                break
    return found


def _stem(name: str) -> str:
    """The name without the words that mark a step of a state (``stateN`` -> ``state``, ``h0`` -> ``h``)."""
    words = [w for w in re.split(r"[^a-z0-9]+|(?<=[a-z])(?=[0-9])", name.lower()) if w]
    while words and words[-1] in _STEP_WORDS:
        words.pop()
    while words and words[0] in _STEP_WORDS:
        words.pop(0)
    if len(words) == 1 and len(words[0]) > 1 and words[0].endswith("n") and words[0][:-1].isalpha():
        return words[0][:-1]  # stateN, hn: the trailing N of "next" (hidden_in and hidden_out lose it alike)
    return "_".join(words)


def _same_shape(a: onnx.ValueInfoProto, b: onnx.ValueInfoProto) -> bool:
    """Whether two values have the same element type and shape, as far as the model says (a rank is required)."""
    ta, tb = a.type.tensor_type, b.type.tensor_type
    if ta.elem_type != tb.elem_type or not ta.HasField("shape") or not tb.HasField("shape"):
        return False
    da, db = list(ta.shape.dim), list(tb.shape.dim)
    if len(da) != len(db):
        return False
    for x, y in zip(da, db, strict=True):
        if x.HasField("dim_value") and y.HasField("dim_value") and x.dim_value != y.dim_value:
            return False
    return True
