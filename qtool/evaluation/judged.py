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
from dataclasses import dataclass, field, replace

import onnx

from qtool.calibration.decoder import model_decoder
from qtool.errors import QtoolError
from qtool.evaluation.output_parts import parts_note
from qtool.evaluation.row_matching import MAX_MATCHED_ROWS, selection_ordered

# name parts that mark one step of a state: what is left of both names must be the same
_STEP_WORDS = ("input", "output", "in", "out", "prev", "next", "new", "old", "past", "present", "n", "0", "1", "t")


@dataclass(frozen=True)
class JudgedOutputs:
    """The outputs a target judges, and the ones left out with why."""

    judged: tuple[str, ...]
    state: dict[str, str]  # output -> the input it feeds back (recognised, not judged)
    named: bool  # the user named the judged outputs
    # judged output -> the TopK / NonMaxSuppression node that selects and orders its rows (see reordering_note)
    reordered: dict[str, str] = field(default_factory=dict)

    @property
    def subset(self) -> frozenset[str] | None:
        """The judged outputs when they are not all of them (None: every output)."""
        return frozenset(self.judged) if self.state or self.named else None

    def note(self, parts: Sequence[str] = ()) -> str:
        """What the target judges, in words (empty when it is every output as usual).

        ``parts``: the output parts also measured on their own (:mod:`qtool.evaluation.output_parts`).
        """
        notes = (self._judged_note(), self.reordering_note(), parts_note(parts))
        return "; ".join(note for note in notes if note)

    def reordering_note(self) -> str:
        """Which judged outputs a selection orders, compared as sets of rows (see :mod:`row_matching`; "": none)."""
        if not self.reordered:
            return ""
        listed = ", ".join(f"'{out}' (by {node})" for out, node in self.reordered.items())
        return (
            f"rows ordered by a selection in the graph: {listed}; compared as sets of rows, each of the quantized "
            f"model's rows paired with the float model's nearest (where two scores nearly tie the rows trade places; "
            f"up to {MAX_MATCHED_ROWS} rows)"
        )

    def _judged_note(self) -> str:
        if self.named:
            carried = ", ".join(f"{out} -> {inp}" for out, inp in sorted(self.state.items()))
            fed = f"; state fed back: {carried}" if carried else ""
            return f"the target judges the outputs named: {', '.join(self.judged)}{fed}"
        if not self.state:
            return ""
        fed = ", ".join(f"{out} (fed back as {inp})" for out, inp in sorted(self.state.items()))
        return (
            f"the target judges {', '.join(self.judged)}; state outputs are reported, not judged: {fed} "
            "(name the judged outputs with accuracy.outputs or --outputs)"
        )


def judged_outputs(
    model: onnx.ModelProto,
    patterns: Sequence[str] = (),
    source: str = "--outputs",
    pairs: Sequence[tuple[str, str]] = (),
) -> JudgedOutputs:
    """The outputs of ``model`` a target judges: those ``patterns`` name (exact or ``re:``), else all but the state.

    ``pairs`` (output, input): the state the model feeds back, as the config gives it (``accuracy.state``);
    without them it is recognised by name and shape. Named outputs are judged; the state is carried all the same.

    Raises:
        QtoolError: a pattern names no output of the model, or a pair names no output or input of it.
    """
    outputs = [o.name for o in model.graph.output]
    decoder = model_decoder(model) is not None
    state = _given_state(model, pairs) if pairs else {} if decoder else _state_outputs(model)
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
        return _with_reordering(JudgedOutputs(tuple(named), state, named=True), model)
    judged = tuple(name for name in outputs if name not in state)
    if not judged:  # every output is state: nothing else to judge by
        return _with_reordering(JudgedOutputs(tuple(outputs), {}, named=False), model)
    return _with_reordering(JudgedOutputs(judged, state, named=False), model)


def _with_reordering(judged: JudgedOutputs, model: onnx.ModelProto) -> JudgedOutputs:
    """``judged`` with the judged outputs a TopK or NonMaxSuppression orders (compared as sets of rows)."""
    found = {out: node for out, node in selection_ordered(model).items() if out in judged.judged}
    return replace(judged, reordered=found) if found else judged


def _given_state(model: onnx.ModelProto, pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """``accuracy.state`` checked against the model: each key an output, each value an input of the same shape."""
    outputs = {v.name: v for v in model.graph.output}
    inputs = {v.name: v for v in model.graph.input}
    for output, fed in pairs:
        if output not in outputs:
            raise QtoolError(
                f"accuracy.state: '{output}' is no output of the model", hint=f"its outputs are: {', '.join(outputs)}"
            )
        if fed not in inputs:
            raise QtoolError(
                f"accuracy.state: '{fed}' (fed by {output}) is no input of the model",
                hint=f"its inputs are: {', '.join(inputs)}",
            )
        if not _same_shape(inputs[fed], outputs[output]):
            raise QtoolError(f"accuracy.state: output '{output}' and input '{fed}' differ in type or shape")
    return dict(pairs)


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(pattern[3:], name) is not None if pattern.startswith("re:") else pattern == name


def _state_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Outputs whose name and shape pair with an input's: output -> input, each input fed once.

    The closest names pair first: with only the words of a step dropped (``out_cache1`` -> ``in_cache1``), then
    with a trailing step number or ``n`` dropped too (``stateN`` -> ``state``, ``hn`` -> ``h0``).
    """
    inputs = {v.name: v for v in model.graph.input}
    found: dict[str, str] = {}
    for stem in (_exact_stem, _stem):
        for output in model.graph.output:
            key = stem(output.name)
            if output.name in found or not key:
                continue
            for name, value in inputs.items():
                taken = name in found.values()
                if not taken and name != output.name and stem(name) == key and _same_shape(value, output):
                    found[output.name] = name
                    break
    return found


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+|(?<=[a-z])(?=[0-9])", name.lower()) if w]


def _exact_stem(name: str) -> str:
    """The name without the words of a step that are not numbers (``in_cache1`` -> ``cache_1``)."""
    return "_".join(w for w in _words(name) if w not in _STEP_WORDS or w.isdigit())


def _stem(name: str) -> str:
    """The name without the words that mark a step of a state (``stateN`` -> ``state``, ``h0`` -> ``h``)."""
    words = _words(name)
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
