"""Model-local functions (as onnxscript and torch's exporter write modules) inlined, so their weights are seen."""

from __future__ import annotations

import onnx
import onnx.inliner

from qtool.graph.index import all_nodes


def inline_local_functions(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with every call of one of its own functions replaced by the function's nodes; the functions called.

    A weight a function reads as an input is an initializer of the graph that calls it, but the MatMul or Conv
    reading it lives inside the function, where nothing is planned: such a model was passed through whole.
    Inlined (onnx's inliner, recursively, bodies included), every op is a node of the graph.
    """
    local = {(f.domain, f.name) for f in model.functions}
    called = sorted({f"{n.domain}:{n.op_type}" for n in all_nodes(model.graph) if (n.domain, n.op_type) in local})
    if not called:
        return model, []
    inlined = onnx.inliner.inline_local_functions(model)
    del inlined.functions[:]
    return inlined, called
