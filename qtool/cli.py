"""The ``qtool`` command line: parse options, call :mod:`qtool.api`, render the result.

Every command turns a :class:`~qtool.errors.QtoolError` into one red line and its
exit code; anything else is a bug and is shown with a traceback (exit 70).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from qtool import __version__
from qtool.errors import CheckFailedError, ExitCode, QtoolError
from qtool.options import CalibrationOptions, EvaluationOptions, OutputOptions, SearchOptions

app = typer.Typer(
    name="qtool",
    help="Quantize ONNX models: calibrate activation ranges, rewrite to int8 QDQ, compare with the float model.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
err_console = Console(stderr=True)
out_console = Console()
_state = {"debug": False, "quiet": False}
_silent = Console(quiet=True)  # where summaries go under --quiet
PIPE_WIDTH = 4096  # not a terminal: never wrap lines or cut table cells
T = TypeVar("T")


class _RateColumn(ProgressColumn):
    """Samples (or runs) per second."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.1f}/s" if speed else "-/s", style="progress.data.speed")


@contextmanager
def _progress() -> Iterator[Callable[[str, int], Callable[[int], None]]]:
    """A progress-bar factory; the display starts with the first task, so errors before it print cleanly."""
    columns = (
        TextColumn("{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
    )
    hidden = _state["quiet"] or not err_console.is_terminal  # bars are for people watching a terminal
    progress = Progress(*columns, console=err_console, transient=False, disable=hidden)

    def factory(description: str, total: int) -> Callable[[int], None]:
        if not progress.live.is_started:
            progress.start()
        task = progress.add_task(description, total=total)
        return lambda n: progress.advance(task, n)

    try:
        yield factory
    except BaseException:
        progress.live.transient = True  # a failed run leaves only its error message behind
        raise
    finally:
        if progress.live.is_started:
            progress.stop()


def _fail(message: str, code: ExitCode) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(int(code))


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C (outputs not yet committed are removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _run(
    action: Callable[[], T],
    outputs: dict[str, Path | str | None] | None = None,
    inputs: tuple[Path | str | None, ...] = (),
) -> T:
    """Run a command body, mapping errors to messages and exit codes.

    Before any work, ``outputs`` (option -> path) are checked: writable, distinct, and never one of
    ``inputs`` (see :func:`qtool.system.outputs.check_outputs`). Every file the body writes is staged and
    committed together when it succeeds; on an error, Ctrl-C, SIGTERM or SIGHUP none is written.
    """
    from qtool.system.outputs import ENVIRONMENT_ERRNOS, check_outputs, transaction

    files: dict[str, Path | str | None] = {k: v for k, v in (outputs or {}).items() if v is not None and str(v) != "-"}
    started = time.time_ns()
    stopped: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else _Stopped(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, on_signal) for signum in _STOP_SIGNALS}
    try:
        check_outputs(files, _with_data_files(inputs))
        with transaction(keep_on=(CheckFailedError,)):  # a failed gate's reports are its result
            return action()
    except QtoolError as e:
        if _state["debug"]:
            traceback.print_exc()
        _fail(_one_line(str(e)), e.exit_code)
    except KeyboardInterrupt as e:
        _interrupted(files, started, e.signum if isinstance(e, _Stopped) else signal.SIGINT)
    except typer.Exit:
        raise
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            _internal_error(stopped, files, started)
        if _state["debug"]:
            traceback.print_exc()
        _fail(_one_line(f"{e.filename or 'I/O'}: {e.strerror or e}"), ExitCode.BAD_INPUT)
    except Exception:  # noqa: BLE001 - anything else is a qtool bug: show it, ask for a report
        _internal_error(stopped, files, started)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    raise AssertionError("unreachable")


def _internal_error(stopped: list[int], files: dict[str, Path | str | None], started: int) -> NoReturn:
    if stopped:  # a signal inside native code (onnxruntime's import) surfaces as its own error type
        _interrupted(files, started, stopped[0])
    traceback.print_exc()
    _fail(f"internal error in qtool {__version__}; please report it with the traceback above", ExitCode.INTERNAL)
    raise AssertionError("unreachable")


def _with_data_files(inputs: tuple[Path | str | None, ...]) -> list[Path]:
    """The inputs, with the external data files of the models among them."""
    from qtool.graph.model_io import model_files

    found: list[Path] = []
    for item in inputs:
        if item is not None and str(item) != "-":
            found.extend(model_files(item))
    return found


def _one_line(message: str) -> str:
    """A message as one line: control characters (newlines, terminal escapes) from file contents escaped."""
    from qtool.reports.terminal import printable

    return printable(message, markup=False)


def _interrupted(files: dict[str, Path | str | None], started: int, signum: int) -> NoReturn:
    name = signal.Signals(signum).name
    from qtool.reports.terminal import printable

    paths = [Path(str(p)) for p in files.values()]
    written = [printable(str(p)) for p in paths if p.is_file() and p.stat().st_mtime_ns >= started]
    if written:  # a signal after the commit: the outputs are complete
        err_console.print(f"[red]interrupted[/red] ({name}) after writing {', '.join(written)} (complete)")
    else:
        err_console.print(f"[red]interrupted[/red] ({name}): no output was written", highlight=False)
    raise typer.Exit(128 + signum)


def _shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    k, sep, n = text.partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit() or not 1 <= int(k) <= int(n):
        raise QtoolError(f"--shard expects K/N with 1 <= K <= N, got '{text}'")
    return int(k), int(n)


def _observer_options(pairs: list[str] | None) -> dict[str, Any]:
    """Parse KEY=VALUE pairs; values are read as YAML scalars (numbers, booleans, strings)."""
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise QtoolError(f"--observer-option expects KEY=VALUE, got '{pair}'")
        options[key.strip()] = yaml.safe_load(value)
    return options


def _write_json(target: str, text: str) -> None:
    if target == "-":
        sys.stdout.write(text)
    else:
        from qtool.graph.model_io import write_text

        write_text(target, text)


def _version(value: bool) -> None:
    if value:
        out_console.print(f"qtool {__version__}")
        raise typer.Exit()


class _Printable(logging.Filter):
    """Log lines with the control characters of names from the user's files escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        from qtool.reports.terminal import printable

        record.msg, record.args = printable(record.getMessage(), markup=False), None
        return True


def _log_handler() -> logging.Handler:
    """Rich's aligned lines on a terminal; plain ``LEVEL: message`` lines in a pipe (no padding)."""
    handler: logging.Handler
    if err_console.is_terminal:
        handler = RichHandler(console=err_console, show_time=False, show_path=False, markup=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    handler.addFilter(_Printable())
    return handler


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for user errors too.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each stage with its duration.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only errors and the outputs asked for (no tables, no bars).")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Never wrap lines or cut table cells (always so when output is piped).")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Quantize ONNX models."""
    if quiet and verbose:
        raise typer.BadParameter("--quiet and --verbose contradict each other", param_hint="--quiet")
    _state["debug"] = debug
    _state["quiet"] = quiet
    for console in (out_console, err_console):
        if wide or not console.is_terminal:
            console.width = PIPE_WIDTH
            console.soft_wrap = True
    logging.basicConfig(
        level=logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[_log_handler()],
        force=True,
    )


def _summary_console(json_out: str | None) -> Console:
    """Where a command's human-readable summary goes: stderr when JSON takes stdout, nowhere when quiet."""
    if _state["quiet"]:
        return _silent
    return err_console if json_out == "-" else out_console


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", metavar="CONFIG.yaml", help="QConfigDict YAML; merged over the built-in configs/default.yaml."
    ),
]
ObserverOption = Annotated[
    str | None,
    typer.Option(
        "--observer",
        metavar="NAME",
        help="Observer for activation ranges (default: calibration.observer of the config, minmax).",
    ),
]
ShardOption = Annotated[
    str | None,
    typer.Option(
        "--shard",
        metavar="K/N",
        help="Process only shard K/N of the samples (every N-th file from the K-th); merge the "
        "shards' statistics with 'qtool merge'.",
    ),
]
SkipNonfiniteOption = Annotated[
    bool,
    typer.Option(
        "--skip-nonfinite", help="Skip samples holding NaN or Inf (counted in the summary) instead of failing."
    ),
]
ObserverOptionsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--observer-option",
        metavar="KEY=VALUE",
        help="Observer option KEY=VALUE, repeatable (e.g. percentile=99.9, bins=4096); see 'qtool observers'.",
    ),
]
BatchOption = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        metavar="N",
        min=1,
        help="Samples per inference when the batch dimension is dynamic (default: calibration.batch_size).",
    ),
]
LimitOption = Annotated[
    int | None, typer.Option("--limit", metavar="N", min=1, help="Use only the first N samples (sorted by file name).")
]
JsonOption = Annotated[
    str | None,
    typer.Option(
        "--json",
        metavar="PATH|-",
        help="Also write the result as JSON to PATH, or '-' for stdout (tables then go to stderr).",
    ),
]
RunsOption = Annotated[
    int, typer.Option("--runs", metavar="N", min=0, help="Timed runs per model for latency (0 skips latency).")
]
WarmupOption = Annotated[int, typer.Option("--warmup", metavar="N", min=0, help="Untimed warm-up runs per model.")]
ThreadsOption = Annotated[
    int | None,
    typer.Option("--threads", metavar="N", min=1, help="onnxruntime intra-op threads (default: onnxruntime's choice)."),
]


@app.command()
def calibrate(
    model: Annotated[Path, typer.Argument(help="Float ONNX model.", show_default=False, metavar="MODEL")],
    data_dir: Annotated[
        Path, typer.Argument(help="Directory of samples (*.npy or *.npz).", show_default=False, metavar="DATA_DIR")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="PATH", help="Statistics JSON file to write.")],
    config: ConfigOption = None,
    observer: ObserverOption = None,
    observer_option: ObserverOptionsOption = None,
    batch_size: BatchOption = None,
    limit: LimitOption = None,
    shard: ShardOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    json_out: JsonOption = None,
) -> None:
    """Run the float model over DATA_DIR and write activation statistics to -o STATS.json."""

    def action() -> None:
        from qtool.api import calibrate as run_calibrate
        from qtool.api import write_stats
        from qtool.reports.documents import stats_summary_dict, to_json
        from qtool.reports.terminal import printable

        with _progress() as progress:
            options = CalibrationOptions(
                observer=observer,
                observer_options=_observer_options(observer_option),
                batch_size=batch_size,
                limit=limit,
                shard=_shard(shard),
                skip_nonfinite=skip_nonfinite,
            )
            stats = run_calibrate(model, data_dir, config_path=config, options=options, progress=progress)
        write_stats(stats, output)
        console = _summary_console(json_out)
        if stats.skipped:
            console.print(f"[yellow]skipped[/yellow] {stats.skipped} samples holding NaN or Inf")
        console.print(
            f"[green]wrote[/green] {printable(str(output))}: {len(stats.tensors)} tensors observed with "
            f"'{printable(stats.observer)}' over {stats.samples} samples"
        )
        if json_out:
            _write_json(json_out, to_json(stats_summary_dict(stats, str(output))))

    _run(action, {"-o": output, "--json": json_out}, (model, data_dir, config))


@app.command()
def quantize(
    model: Annotated[Path, typer.Argument(help="Float ONNX model.", show_default=False, metavar="MODEL")],
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="PATH", help="Quantized ONNX model to write (never the input).")
    ],
    config: ConfigOption = None,
    stats: Annotated[
        Path | None, typer.Option("--stats", metavar="STATS.json", help="Statistics from 'qtool calibrate'.")
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            metavar="DATA_DIR",
            help="Calibrate on this directory now (instead of --stats), "
            "then compare the result with the float model on it.",
        ),
    ] = None,
    observer: ObserverOption = None,
    observer_option: ObserverOptionsOption = None,
    batch_size: BatchOption = None,
    limit: LimitOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    runs: RunsOption = 20,
    warmup: WarmupOption = 3,
    threads: ThreadsOption = None,
    target_sqnr: Annotated[
        float | None,
        typer.Option(
            "--target-sqnr",
            metavar="DB",
            help="Sensitivity search target in dB (default: the config's accuracy.target_sqnr_db, 30): "
            "the integer nodes that hurt most get float activations until the outputs reach it.",
        ),
    ] = None,
    max_float_nodes: Annotated[
        int | None,
        typer.Option("--max-float-nodes", metavar="N", help="At most this many nodes get float activations."),
    ] = None,
    search_data: Annotated[
        Path | None,
        typer.Option(
            "--search-data",
            metavar="DATA_DIR",
            help="Samples for the sensitivity search (default: --data; needed with --stats).",
        ),
    ] = None,
    no_search: Annotated[bool, typer.Option("--no-search", help="Skip the sensitivity search.")] = False,
    external_data: Annotated[
        bool | None,
        typer.Option(
            "--external-data/--embed-data",
            help="Write the weights to OUT.onnx.<digest>.data beside the model, or embed them "
            "(default: embed, unless the model would exceed protobuf's 2 GiB limit).",
            show_default=False,
        ),
    ] = None,
    opset: Annotated[
        int | None,
        typer.Option(
            "--opset",
            metavar="N",
            min=1,
            help="Default-domain opset of the output (default: the model's, raised to what the config needs and "
            "lowered to the newest at which onnxruntime has QuantizeLinear/DequantizeLinear kernels).",
            show_default=False,
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Quantize MODEL to int8 QDQ using --stats or --data, and write it to -o OUT.onnx."""

    def action() -> None:
        from qtool.api import quantize as run_quantize
        from qtool.reports.documents import quantize_to_dict, to_json
        from qtool.reports.tables import render_quantize

        with _progress() as progress:
            result = run_quantize(
                model,
                output,
                config_path=config,
                stats_path=stats,
                data_dir=data,
                calibration=CalibrationOptions(
                    observer=observer,
                    observer_options=_observer_options(observer_option),
                    batch_size=batch_size,
                    limit=limit,
                    skip_nonfinite=skip_nonfinite,
                ),
                search=None
                if no_search
                else SearchOptions(target_sqnr_db=target_sqnr, max_float_nodes=max_float_nodes, data_dir=search_data),
                evaluation=EvaluationOptions(
                    runs=runs, warmup=warmup, threads=threads, limit=limit, skip_nonfinite=skip_nonfinite
                ),
                output=OutputOptions(external_data=external_data, opset=opset),
                progress=progress,
            )
        render_quantize(_summary_console(json_out), result)
        if json_out:
            _write_json(json_out, to_json(quantize_to_dict(result)))

    _run(action, {"-o": output, "--json": json_out}, (model, config, stats, data, search_data))


@app.command()
def compare(
    reference: Annotated[
        Path, typer.Argument(help="Reference (float) ONNX model.", show_default=False, metavar="REFERENCE")
    ],
    candidate: Annotated[
        Path, typer.Argument(help="Candidate (quantized) ONNX model.", show_default=False, metavar="CANDIDATE")
    ],
    data: Annotated[Path, typer.Option("--data", metavar="DATA_DIR", help="Directory of evaluation samples.")],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", metavar="CONFIG.yaml", help="QConfigDict YAML whose preprocess: block reads images."
        ),
    ] = None,
    limit: LimitOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    task: Annotated[
        str,
        typer.Option(
            "--task",
            metavar="TASK",
            help="auto: top-1/top-5 agreement for 2-D [N, C] outputs; classification: for every output; none.",
        ),
    ] = "auto",
    per_layer: Annotated[
        bool, typer.Option("--per-layer", help="Pair every intermediate float tensor and report which layer hurts.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="PLOT.png",
            help="Draw per-layer SQNR to this PNG (implies --per-layer; needs qtool-onnx[plot]).",
        ),
    ] = None,
    providers: Annotated[
        str,
        typer.Option(
            "--providers",
            metavar="LIST",
            help="Execution providers for latency, comma-separated: cpu, cuda, tensorrt "
            "or full onnxruntime names. Unavailable ones are reported as skipped.",
        ),
    ] = "cpu",
    runs: RunsOption = 50,
    warmup: WarmupOption = 5,
    threads: ThreadsOption = None,
    json_out: JsonOption = None,
    markdown: Annotated[
        Path | None,
        typer.Option("--markdown", metavar="REPORT.md", help="Write a Markdown report (e.g. to $GITHUB_STEP_SUMMARY)."),
    ] = None,
    junit: Annotated[
        Path | None, typer.Option("--junit", metavar="GATES.xml", help="Write the gates as JUnit XML test cases.")
    ] = None,
    fail_under: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-under",
            metavar="METRIC=VALUE",
            help="Gate METRIC=VALUE that fails below VALUE: sqnr, cosine, top1, top5, compression. Repeatable.",
        ),
    ] = None,
    fail_over: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-over",
            metavar="METRIC=VALUE",
            help="Gate METRIC=VALUE that fails above VALUE: mse, max_abs_error, latency_ratio. Repeatable.",
        ),
    ] = None,
    min_compression: Annotated[
        float | None,
        typer.Option(
            "--min-compression", metavar="RATIO", help="Gate: on-disk compression ratio must be at least this."
        ),
    ] = None,
    max_latency_ratio: Annotated[
        float | None,
        typer.Option(
            "--max-latency-ratio",
            metavar="RATIO",
            help="Gate: candidate/reference median latency on the first provider must be at most this.",
        ),
    ] = None,
) -> None:
    """Compare CANDIDATE with REFERENCE: size, accuracy, per-layer error, latency per provider; judge gates.

    Exit code 1 when any gate fails (after printing every gate), 2 on bad input.
    """

    def action() -> None:
        from qtool.api import compare as run_compare
        from qtool.evaluation.gates import parse_gates
        from qtool.evaluation.providers import parse_providers
        from qtool.graph.model_io import write_text
        from qtool.reports.ci import to_junit, to_markdown
        from qtool.reports.documents import comparison_to_dict, to_json
        from qtool.reports.tables import render_comparison

        gates = parse_gates(fail_under, fail_over, min_compression, max_latency_ratio)
        chosen = parse_providers(providers)
        if plot is not None:
            from qtool.reports.plot import require_matplotlib

            require_matplotlib()
        with _progress() as progress:
            options = EvaluationOptions(
                runs=runs,
                warmup=warmup,
                threads=threads,
                limit=limit,
                skip_nonfinite=skip_nonfinite,
                task=task,
                per_layer=per_layer or plot is not None,
                providers=tuple(chosen),
            )
            result = run_compare(
                reference, candidate, data, options=options, config_path=config, gates=gates, progress=progress
            )
        render_comparison(_summary_console(json_out), result)
        if json_out:
            _write_json(json_out, to_json(comparison_to_dict(result)))
        if markdown:
            write_text(markdown, to_markdown(result))
        if junit:
            write_text(junit, to_junit(result))
        if plot is not None:
            from qtool.reports.plot import plot_layers

            plot_layers(result.layers or [], plot)
        if not result.gates_passed:
            failed = [g.gate.label for g in result.gates if not g.passed]
            raise CheckFailedError(f"{len(failed)} of {len(result.gates)} gates failed: {', '.join(failed)}")

    outputs = {"--json": json_out, "--markdown": markdown, "--junit": junit, "--plot": plot}
    _run(action, outputs, (reference, candidate, data, config))


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model.", show_default=False, metavar="MODEL")],
    config: ConfigOption = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            metavar="DATA_DIR",
            help="Sample directory: its first sample sizes the tensors that dynamic shapes leave "
            "open, so placement 'auto' decides exactly as quantize will.",
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Show what quantize would do: every node's scheme and the rule behind it, sizes, and what stays float."""

    def action() -> None:
        from qtool.api import inspect as run_inspect
        from qtool.reports.documents import inspection_to_dict, to_json
        from qtool.reports.tables import render_inspection

        result = run_inspect(model, config_path=config, data_dir=data)
        render_inspection(_summary_console(json_out), result)
        if json_out:
            _write_json(json_out, to_json(inspection_to_dict(result)))

    _run(action, {"--json": json_out}, (model, config, data))


@app.command()
def merge(
    stats: Annotated[
        list[Path],
        typer.Argument(help="Statistics files of shards of one dataset.", show_default=False, metavar="STATS.json..."),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="PATH", help="Merged statistics JSON file to write.")
    ],
) -> None:
    """Merge statistics of dataset shards (from 'qtool calibrate --shard K/N') into one file."""

    def action() -> None:
        from qtool.api import merge_stats, write_stats
        from qtool.reports.terminal import printable

        merged = merge_stats(list(stats))
        write_stats(merged, output)
        _summary_console(None).print(
            f"[green]wrote[/green] {printable(str(output))}: merged {len(stats)} files, "
            f"{merged.samples} samples, {len(merged.tensors)} tensors"
        )

    _run(action, {"-o": output}, tuple(stats))


@app.command()
def observers(json_out: JsonOption = None) -> None:
    """List the observers for --observer and calibration.observer: built-ins and installed plugins."""

    def action() -> None:
        from qtool.observers import describe_observers
        from qtool.reports.documents import to_json
        from qtool.reports.tables import render_observers

        rows = describe_observers()
        render_observers(_summary_console(json_out), rows)
        if json_out:
            _write_json(json_out, to_json({"schema_version": 1, "observers": rows}))

    _run(action, {"--json": json_out})


@app.command()
def schema(
    name: Annotated[
        str,
        typer.Argument(
            help="config, stats, calibrate-report, quantize-report or compare-report.",
            show_default=False,
            metavar="NAME",
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="PATH", help="Write it here instead of stdout.")
    ] = None,
) -> None:
    """Print the JSON Schema of a file qtool reads (config, stats) or a report it writes."""

    def action() -> None:
        from qtool.reports.documents import to_json
        from qtool.schemas import json_schema

        text = to_json(json_schema(name))
        if output is None:
            sys.stdout.write(text)
        else:
            from qtool.graph.model_io import write_text

            write_text(output, text)

    _run(action, {"-o": output})


@app.command()
def doctor(json_out: JsonOption = None) -> None:
    """Check this machine: versions, execution providers (each loaded once), CPU features, GPUs."""

    def action() -> None:
        from qtool.reports.documents import doctor_to_dict, to_json
        from qtool.reports.tables import render_doctor
        from qtool.system.doctor import diagnose

        result = diagnose()
        render_doctor(_summary_console(json_out), result)
        if json_out:
            _write_json(json_out, to_json(doctor_to_dict(result)))

    _run(action, {"--json": json_out})


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    return app(args=argv)
