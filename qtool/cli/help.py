"""``--help`` in groups: what a command reads, what it writes, then the knobs by topic.

The options of a command are grouped by what they are for (a table below, by option name), so an
87-line help reads as a few short sections; defaults are shown where the option has one.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

_INPUTS = ("--data", "--stats", "--search-data", "--eval", "--config", "--input-shapes", "--target", "--labels")
_OUTPUTS = (
    *("--output", "--json", "--markdown", "--junit", "--plot", "--config-out", "--external-data", "--opset"),
    *("--tensorrt-cache", "--tensorrt-version"),
)
_ACCURACY = (
    *("--target-sqnr", "--max-float-nodes", "--search-samples", "--search-seconds", "--latency-runs", "--search"),
    *("--metric", "--target-metric", "--lower-is-better", "--objective", "--time-budget", "--confidence"),
    *("--sensitivity-samples", "--cache", "--cache-dir", "--target-decode"),
)
_CALIBRATION = (
    *("--observer", "--observer-option", "--batch-size", "--limit", "--shard", "--workers", "--scheduler"),
    "--skip-nonfinite",
)
_EVALUATION = (
    *("--runs", "--warmup", "--providers", "--require-providers", "--trt-engine-cache", "--task", "--per-layer"),
    *("--fail-under", "--fail-over", "--min-compression", "--max-latency-ratio", "--latency-tolerance"),
    *("--baseline", "--fail-on-regression", "--decode-steps"),
)
GROUPS = (
    ("Inputs", _INPUTS),
    ("Outputs", _OUTPUTS),
    ("Accuracy and placement", _ACCURACY),
    ("Calibration", _CALIBRATION),
    ("Evaluation and gates", _EVALUATION),
)


def _group(names: list[str]) -> str:
    for title, options in GROUPS:
        if any(
            name in options or name.removeprefix("--no-") in (o.removeprefix("--") for o in options) for name in names
        ):
            return title
    return "Other options"


class GroupedCommand(TyperCommand):
    """A command whose ``--help`` lists its options in titled groups, in the order of :data:`GROUPS`."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments: list[tuple[str, str]] = []
        grouped: dict[str, list[tuple[str, str]]] = {title: [] for title, _ in GROUPS}
        grouped["Other options"] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                grouped[_group([*param.opts, *param.secondary_opts])].append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        for title, records in grouped.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)
