"""The placement choice's decision: the most accurate placement that reaches the target, unless another is
decisively faster on paired, interleaved rounds."""

from __future__ import annotations

from qtool.quantization.selection import PlacementCandidate, PlacementChoice, _decide, decisively_faster


def _choice(times: dict[str, list[float]], sqnr: dict[str, float], target: float = 30.0) -> PlacementChoice:
    candidates = [
        PlacementCandidate(name, (), 1 if name != "storage" else 0, 0, sqnr[name], sqnr[name] >= target, 1.0)
        for name in sqnr
    ]
    return PlacementChoice(target, [], 1, candidates, "auto", "", fp32_ms=1.0, times=times)


def test_decisively_faster_needs_the_whole_interval_below_the_tie():
    slow = [1.0] * 9
    assert decisively_faster({"a": [0.8] * 9, "b": slow}, "a", "b")
    assert not decisively_faster({"a": [0.97] * 9, "b": slow}, "a", "b")  # within 5 %
    assert not decisively_faster({"a": [0.8] * 3, "b": slow[:3]}, "a", "b")  # too few rounds for an interval


def test_the_most_accurate_placement_is_kept_when_none_is_decisively_faster():
    choice = _choice({"fp32": [1.0] * 9, "auto": [0.99] * 9, "storage": [1.0] * 9}, {"auto": 35.0, "storage": 40.0})
    _decide(choice)
    assert choice.chosen == "storage" and "most accurate" in choice.reason


def test_a_decisively_faster_placement_that_reaches_the_target_wins():
    choice = _choice({"fp32": [1.0] * 9, "auto": [0.6] * 9, "storage": [1.0] * 9}, {"auto": 32.0, "storage": 40.0})
    _decide(choice)
    assert choice.chosen == "auto" and "faster" in choice.reason


def test_when_none_reaches_the_target_the_most_accurate_is_kept():
    choice = _choice({"fp32": [1.0] * 9, "auto": [0.5] * 9, "storage": [1.0] * 9}, {"auto": 12.0, "storage": 20.0})
    _decide(choice)
    assert choice.chosen == "storage" and "no placement reaches" in choice.reason
