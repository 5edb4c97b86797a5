"""Option groups: a group's flags stand in --help where its parameter sits, and the command gets the record."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from qtool.cli import app
from qtool.cli.groups import OptionGroup, filled, option_groups
from qtool.cli.options import Sampling, Timing
from qtool.options import EvaluationOptions
from tests.conftest import calib_dir, sample

runner = CliRunner()
CountOption = Annotated[int, typer.Option("--count", metavar="N", min=1, help="How many.")]
NameOption = Annotated[str | None, typer.Option("--name", metavar="NAME", help="Which one.")]


@dataclass(frozen=True, kw_only=True)
class Inner(OptionGroup):
    name: NameOption = None


@dataclass(frozen=True, kw_only=True)
class Outer(OptionGroup):
    count: CountOption = 1
    inner: Inner = field(default_factory=lambda: Inner(name="x"))


SEVEN = Outer(count=7)


def toy(received: list[object]) -> typer.Typer:
    toy_app = typer.Typer(rich_markup_mode=None)

    @toy_app.command()
    @option_groups
    def run(
        first: Annotated[bool, typer.Option("--first", help="Before the group.")] = False,
        *,
        outer: Outer = SEVEN,
        last: Annotated[bool, typer.Option("--last", help="After the group.")] = False,
    ) -> None:
        """Run."""
        received.append((first, outer, last))

    @toy_app.command()
    def other() -> None:
        """Keeps ``run`` a subcommand."""

    return toy_app


def test_the_flags_of_a_group_stand_where_its_parameter_sits():
    received: list[object] = []
    toy_app = toy(received)
    shown = runner.invoke(toy_app, ["run", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}).stdout
    assert [shown.index(flag) for flag in ("--first", "--count", "--name", "--last")] == sorted(
        shown.index(flag) for flag in ("--first", "--count", "--name", "--last")
    )
    assert "default: 7" in shown and "default: x" in shown  # the command's default, then the nested group's
    assert runner.invoke(toy_app, ["run", "--count", "3", "--last"]).exit_code == 0
    assert received == [(False, Outer(count=3, inner=Inner(name="x")), True)]


def test_a_bad_value_of_a_group_flag_is_a_usage_error_naming_the_flag():
    received: list[object] = []
    result = runner.invoke(toy(received), ["run", "--count", "0"])
    assert result.exit_code == 2 and "Invalid value for '--count'" in result.stderr
    assert received == []


def test_a_flag_name_used_twice_is_refused():
    def twice(a: Outer, b: Outer) -> None:
        """Twice."""

    with pytest.raises(TypeError, match="used twice"):
        option_groups(twice)


def test_a_record_is_filled_from_the_groups_fields_of_its_names():
    options = filled(EvaluationOptions, Timing(runs=3), Sampling(limit=2), task="none")
    assert (options.runs, options.warmup, options.limit, options.task) == (3, 5, 2, "none")


def test_the_commands_take_one_record_per_group():
    for command in ("calibrate", "quantize", "compare", "tune"):
        callback = next(c.callback for c in app.registered_commands if c.callback.__name__ == command)
        assert len(inspect.signature(callback.__wrapped__).parameters) <= 8
        assert len(inspect.signature(callback).parameters) > 15  # what Typer sees


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--observer-option", "percentile"], "--observer-option expects KEY=VALUE, got 'percentile'"),
        (["--runs", "-1"], "Invalid value for '--runs'"),
    ],
)
def test_bad_values_of_shared_flags_still_exit_2_with_their_message(tmp_path, args, message):
    command = ["quantize", str(sample("mlp")), "--data", str(calib_dir("mlp")), "-o", str(tmp_path / "q.onnx")]
    result = runner.invoke(app, [*command, *args])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split())
    assert not (tmp_path / "q.onnx").exists()
