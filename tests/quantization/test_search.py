"""The sensitivity search's ranking: the movable nodes that add error, largest drop first."""

from __future__ import annotations

from qtool.evaluation.layers import LayerError
from qtool.quantization.search import rank_nodes


def _row(node: str, sqnr: float, source: float, position: int) -> LayerError:
    return LayerError(node + ":out", node, "Conv", sqnr, 0.0, 1.0, source, source - sqnr, position, source)


def test_movable_nodes_are_ranked_by_the_error_they_add_with_their_inputs():
    rows = [_row("a", 40.0, 60.0, 0), _row("b", 20.0, 50.0, 1), _row("c", 35.0, 45.0, 2), _row("d", 10.0, 60.0, 3)]
    ranked = rank_nodes(rows, movable={"a", "b", "c"})
    assert [r.node for r in ranked] == ["b", "a", "c"]  # drops 30, 20, 10; d is not movable


def test_a_node_that_adds_no_error_is_not_ranked_and_each_node_counts_once():
    rows = [_row("a", 50.0, 50.0, 0), _row("b", 30.0, 40.0, 1), _row("b", 20.0, 40.0, 2)]
    ranked = rank_nodes(rows, movable={"a", "b"})
    assert [(r.node, r.position) for r in ranked] == [("b", 2)]  # its larger drop
