"""The placement choice's decision: the most accurate placement that reaches the target, unless another is
decisively faster on paired, interleaved rounds."""

from __future__ import annotations

from qtool.choice.records import PlacementChoice
from qtool.choice.selection import _decide, decisively_faster
from tests.choice.records import candidate


def _choice(times: dict[str, list[float]], sqnr: dict[str, float], target: float = 30.0) -> PlacementChoice:
    candidates = [
        candidate(name, 1 if name != "storage" else 0, 0, sqnr[name], sqnr[name] >= target, 1.0) for name in sqnr
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


class _FakeScore:
    def __init__(self, db: float) -> None:
        self.worst_db = db

    def worst_bound_db(self, confidence: float, signal: object) -> float:
        return self.worst_db - 1.0  # the bound sits a decibel below the figure


def _validator(choice: PlacementChoice, validation_db: dict[str, float], monkeypatch, checked: list[str]):
    """A Validator whose candidates score ``validation_db`` on the validation samples (each scoring in ``checked``)."""
    from qtool.choice import validation as placement_validation
    from qtool.choice.records import Samples

    class Scorer:
        files = ("v0.npy", "v1.npy")

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def score(self, model: str, what: str = "") -> _FakeScore:
            checked.append(model)
            return _FakeScore(validation_db[model])

        def per_sequence(self, score: object) -> None:  # independent samples: no sequence ran closed-loop
            return None

        def release(self) -> None:
            pass

    monkeypatch.setattr(placement_validation, "signal_means", lambda scorers: None)
    float_model = type("F", (), {"scorer": lambda self, *args: Scorer(), "state": {}, "judged": None})()
    samples = Samples(scored=[], ranked=[], validation=["v0", "v1"])  # type: ignore[arg-type]
    plans = {c.name: (None, c.name) for c in choice.candidates}
    return placement_validation.Validator(choice, plans, samples, float_model, (None, lambda *_: lambda _: None))


def _validate(choice: PlacementChoice, validation_db: dict[str, float], monkeypatch) -> list[str]:
    """Run validate_choice with each candidate scoring ``validation_db`` there; returns the candidates checked."""
    from qtool.choice.validation import validate_choice

    checked: list[str] = []
    validator = _validator(choice, validation_db, monkeypatch, checked)
    validate_choice(choice, validator, lambda missed: _decide(choice, missed))
    return checked


def test_after_a_validation_miss_the_next_fastest_candidate_that_met_the_target_is_validated(monkeypatch):
    # integer fastest, auto next (decisively faster than storage), storage the most accurate: as on a YOLOv8n
    times = {"fp32": [1.0] * 9, "integer": [0.5] * 9, "auto": [0.6] * 9, "storage": [1.0] * 9}
    choice = _choice(times, {"integer": 30.2, "auto": 37.0, "storage": 40.0})
    _decide(choice)
    assert choice.chosen == "integer"
    checked = _validate(choice, {"integer": 29.0, "auto": 36.5, "storage": 40.0}, monkeypatch)
    assert checked == ["integer", "auto"] and choice.chosen == "auto"  # not storage, the most accurate
    assert "'integer' (28.00 dB) missed" in choice.reason


def test_when_every_candidate_misses_on_validation_the_best_bound_is_kept(monkeypatch):
    times = {"fp32": [1.0] * 9, "integer": [0.5] * 9, "auto": [0.6] * 9, "storage": [1.0] * 9}
    choice = _choice(times, {"integer": 30.2, "auto": 31.0, "storage": 32.0})
    _decide(choice)
    checked = _validate(choice, {"integer": 25.0, "auto": 29.5, "storage": 28.0}, monkeypatch)
    assert checked == ["integer", "auto", "storage"] and choice.chosen == "auto"
    assert "comes closest" in choice.reason


def test_the_only_placement_that_reached_the_target_says_so_when_it_misses_on_validation(monkeypatch):
    times = {"fp32": [1.0] * 9, "auto": [0.6] * 9, "storage": [1.0] * 9}
    choice = _choice(times, {"auto": 25.0, "storage": 31.0})
    _decide(choice)
    assert choice.chosen == "storage" and "the only placement that reaches 30 dB" in choice.reason
    checked = _validate(choice, {"storage": 27.0}, monkeypatch)
    assert checked == ["storage"] and choice.chosen == "storage"  # nothing else reached it: it stays
    assert choice.reason.endswith(
        "on the scored samples, but not on 2 other samples (26.00 dB, 90% bound): none is validated at 30 dB"
    )


def test_a_search_placement_that_misses_on_validation_is_not_timed_and_the_choice_goes_on_without_it(monkeypatch):
    from qtool.choice.selection import _missed_before_timing
    from qtool.choice.validation import validate_choice

    # the search's placement reaches the target on the scored samples, as storage does; it is not timed yet
    choice = _choice({"fp32": [1.0] * 9, "storage": [1.0] * 9}, {"search": 30.3, "storage": 34.0})
    checked: list[str] = []
    validator = _validator(choice, {"search": 30.0, "storage": 33.9}, monkeypatch, checked)
    missed = _missed_before_timing(choice, validator)
    assert missed == {"search"} and checked == ["search"]  # validated first: its bound (29.0 dB) misses
    assert _decide(choice, missed) and choice.chosen == "storage"
    validate_choice(choice, validator, lambda more: _decide(choice, more))
    assert checked == ["search", "storage"] and choice.chosen == "storage"  # each validated once
    assert [r.choice for r in choice.validations] == ["search", "storage"]
    assert "'search' (29.00 dB) missed" in choice.reason
    # when it is the only placement that reaches the target, it is timed and decided on as before
    alone = _choice({"fp32": [1.0] * 9, "storage": [1.0] * 9}, {"search": 30.3, "storage": 29.0})
    assert _missed_before_timing(alone, _validator(alone, {"search": 30.0}, monkeypatch, [])) == frozenset()


def test_timing_goes_on_only_while_a_comparison_that_matters_is_undecided():
    from qtool.choice.timing import undecided_comparisons

    choice = _choice({}, {"integer": 31.0, "auto": 33.0, "storage": 40.0})
    unsettled = undecided_comparisons(choice, ["integer", "auto", "storage"])
    clear = {"integer": [0.5] * 9, "auto": [0.6] * 9, "storage": [1.0] * 9}
    assert not unsettled(clear)
    noisy = {**clear, "auto": [0.6, 0.6, 0.6, 0.6, 1.0, 1.0, 1.0, 1.0, 0.6]}  # auto vs storage straddles the line
    assert unsettled(noisy) == {"fp32", "auto", "storage"}  # only those go on being timed, with fp32
    assert unsettled({name: values[:3] for name, values in clear.items()})  # too few rounds for an interval
    # a candidate that misses the target holds nothing up (only auto vs storage still counts)
    missing = _choice({}, {"integer": 20.0, "auto": 33.0, "storage": 40.0})
    assert not undecided_comparisons(missing, ["integer", "auto", "storage"])({**clear, "integer": [0.5, 1.2] * 4})


def test_where_the_search_starts_holds_no_timing_up_and_reads_the_medians():
    from qtool.choice.timing import faster_than_storage, undecided_comparisons

    # "unchained" misses the target and storage reaches it: only storage can be kept, so the rounds that would
    # decide "unchained" against storage at the 10 % line are not timed; the search's start reads the median
    choice = _choice({}, {"unchained": 29.4, "storage": 34.0})
    near_line = {"fp32": [1.0] * 9, "unchained": [0.85, 0.92] * 4 + [0.86], "storage": [1.0] * 9}
    assert not undecided_comparisons(choice, ["unchained", "storage"])(near_line)
    choice.times = near_line
    assert faster_than_storage(choice, "storage", "unchained")  # median 0.86: more than 10 % faster
    choice.times = {**near_line, "unchained": [0.93] * 9}
    assert not faster_than_storage(choice, "storage", "unchained")


def test_after_a_validation_miss_the_one_placement_left_is_not_called_the_only_one_that_reaches(monkeypatch):
    times = {"fp32": [1.0] * 9, "integer": [0.5] * 9, "storage": [1.0] * 9}
    choice = _choice(times, {"integer": 31.0, "storage": 40.0})
    _decide(choice)
    assert choice.chosen == "integer"  # decisively faster, both reach the target on the scored samples
    checked = _validate(choice, {"integer": 25.0, "storage": 39.0}, monkeypatch)
    assert checked == ["integer", "storage"] and choice.chosen == "storage"
    assert "the only placement left that reaches 30 dB" in choice.reason, choice.reason
