"""Choose on some samples, validate on others: the records and the loop every measured choice shares.

The placement choice (:mod:`qtool.choice.validation`) and ``tune`` (:mod:`qtool.choice.tune.selection`)
both choose a model on selection samples and then score it on validation samples no choice saw: the
figure a model promises is its bound there. A miss makes the choice again - the placement choice
without the candidates that missed, ``tune`` at a larger selection margin - and each model validated
is one :class:`ValidationRound`. :func:`choose_then_validate` runs that loop for a :class:`Chooser`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

Choice = TypeVar("Choice")


@dataclass(frozen=True)
class Validation:
    """A model scored on validation samples, none of which chose it: the figure it promises."""

    samples: list[str]  # the sample files
    sqnr_db: float  # worst output (the judged ones), the validation samples pooled
    bound_db: float  # its lower confidence bound (per-sample spread)
    meets: bool = False  # the bound reaches the target (no selection margin: this is the promise)
    metric: float | None = None  # tune's metric or decode agreement, when that is the goal
    metric_bound: float | None = None  # its confidence bound
    closed_loop: bool = False  # also run over sequences, feeding its own state back (the worse figures kept)


@dataclass(frozen=True)
class ValidationRound(Generic[Choice]):
    """One choice validated: what was chosen (a placement's name, tune's trial and margin) and its validation."""

    choice: Choice
    validation: Validation


class Chooser(Protocol[Choice]):
    """Makes a choice, and makes it again from what the validation of the last one said."""

    def first(self) -> Choice | None:
        """The first choice to validate (None: nothing to validate)."""
        ...

    def after(self, choice: Choice, validation: Validation) -> Choice | None:
        """The next choice once ``choice`` validated as ``validation`` (None: the choice is made)."""
        ...


def choose_then_validate(
    chooser: Chooser[Choice],
    validate: Callable[[Choice], Validation],
    *,
    key: Callable[[Choice], Hashable] = lambda choice: choice,
    may_validate: Callable[[Sequence[ValidationRound[Choice]]], bool] = lambda rounds: True,
) -> list[ValidationRound[Choice]]:
    """Validate the chooser's choices until it is done; every model validated once, in order.

    ``key``: what makes two choices the same model (validated once: a choice made again reads its
    first validation, and adds no round). ``may_validate(rounds)``: whether one more model may be
    validated (a round limit, a deadline); when not, the loop ends.
    """
    rounds: list[ValidationRound[Choice]] = []
    validated: dict[Hashable, Validation] = {}
    choice = chooser.first()
    while choice is not None:
        model = key(choice)
        if model not in validated:
            if not may_validate(rounds):
                break
            validated[model] = validate(choice)
            rounds.append(ValidationRound(choice, validated[model]))
        choice = chooser.after(choice, validated[model])
    return rounds
