"""What graph preparation changed, in the one line of quantize's summary that says so."""

from __future__ import annotations

from qtool.graph.prepare import PrepareReport


def prepared_line(p: PrepareReport) -> str | None:
    """``prepared: ...``, each change counted, or None when preparation changed nothing worth a line."""
    folds = (
        (p.folded_batchnorms, "folded {} BatchNormalization"),
        (p.folded_affine, "folded {} Mul/Add/Sub/Div by constants into the Conv before them"),
        (p.folded_shapes, "folded {} Shape of constants"),
        (p.folded_weight_layouts, "folded {} layout ops of weights"),
        (p.einsums_as_matmuls, "{} Einsum -> MatMul"),
        (p.folded_computed_weights, "folded {} nodes computing weights from constants"),
        (p.hard_activations, "{} hard-sigmoid/swish (an op, or Add, Clip, Div, Mul) -> HardSigmoid (x Mul)"),
        (p.loops_reading_constant_state, "{} Loop bodies read their constant state as constants"),
        (p.inlined_functions, "inlined the calls of {} model-local functions"),
    )
    done = [words.format(len(nodes)) for nodes, words in folds if nodes]
    if p.constants_to_initializers:
        done.append(f"{p.constants_to_initializers} Constant nodes -> initializers")
    if p.opset_after != p.opset_before:
        done.append(f"opset {p.opset_before} -> {p.opset_after}")
    return "prepared: " + "; ".join(done) if done else None
