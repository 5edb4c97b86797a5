"""``qtool compare``: accuracy, latency and gates for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app, progress_bars, summary_console, write_json
from qtool.cli.options import (
    GateOutputsOption,
    InputShapesOption,
    JsonOption,
    LimitOption,
    RunsOption,
    SkipNonfiniteOption,
    ThreadsOption,
    WarmupOption,
)
from qtool.cli.run import run_command
from qtool.errors import CheckFailedError
from qtool.options import DECODE_STEPS, EvaluationOptions


@app.command()
def compare(
    reference: Annotated[
        Path, typer.Argument(help="Reference (float) ONNX model.", show_default=False, metavar="REFERENCE")
    ],
    candidate: Annotated[
        Path, typer.Argument(help="Candidate (quantized) ONNX model.", show_default=False, metavar="CANDIDATE")
    ],
    data: Annotated[
        str, typer.Option("--data", metavar="DATA_DIR", help="Directory (or fsspec URL) of evaluation samples.")
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", metavar="CONFIG.yaml", help="QConfigDict YAML whose preprocess: block reads images."
        ),
    ] = None,
    input_shapes: InputShapesOption = None,
    limit: LimitOption = None,
    skip_nonfinite: SkipNonfiniteOption = False,
    task: Annotated[
        str,
        typer.Option(
            "--task",
            metavar="TASK",
            help="auto: top-1/top-5 agreement for outputs that hold class scores (Softmax, logits heads, "
            "names; the report says why); classification: for every output; none.",
        ),
    ] = "auto",
    decode_steps: Annotated[
        int,
        typer.Option(
            "--decode-steps",
            metavar="N",
            help="Decoders (a key/value cache): tokens each sample is continued greedily through the cache, "
            "scored step by step and free-running (0: perplexity and next-token agreement only).",
        ),
    ] = DECODE_STEPS,
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
    require_providers: Annotated[
        bool,
        typer.Option(
            "--require-providers",
            help="Fail (exit 2, before any work) when a provider of --providers is not available, "
            "instead of reporting it as skipped: a misconfigured GPU runner cannot pass.",
        ),
    ] = False,
    trt_engine_cache: Annotated[
        Path | None,
        typer.Option(
            "--trt-engine-cache",
            metavar="DIR",
            help="TensorRT: keep built engines in DIR, so later runs on the same models and shapes skip the build.",
        ),
    ] = None,
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
            help="Gate METRIC=VALUE that fails below VALUE: sqnr, cosine, top1, top5, box_iou, compression; "
            "decoders: next_token, decode_agreement, free_running. Repeatable.",
        ),
    ] = None,
    fail_over: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-over",
            metavar="METRIC=VALUE",
            help="Gate METRIC=VALUE that fails above VALUE: mse, max_abs_error, latency_ratio; "
            "decoders: ppl_ratio. Repeatable.",
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
            help="Gate: candidate/reference latency on the first provider (median of paired rounds) must be "
            "at most this; it fails only when the 99 % interval lies wholly above.",
        ),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            metavar="REPORT.json",
            help="An earlier 'compare --json' report (e.g. from main): show the change in size, accuracy "
            "and latency against it in every report.",
        ),
    ] = None,
    fail_on_regression: Annotated[
        bool,
        typer.Option(
            "--fail-on-regression",
            help="With --baseline: exit 1 when size, accuracy or latency got worse than the baseline "
            "beyond its tolerance (each becomes a gate).",
        ),
    ] = False,
    outputs: GateOutputsOption = None,
    latency_tolerance: Annotated[
        str | None,
        typer.Option(
            "--latency-tolerance",
            metavar="PCT",
            help="Slack on --max-latency-ratio, e.g. 5% (or 0.05): fail only above RATIO x (1 + PCT). "
            "Default 2%: sessions of one model differ by about 1%.",
        ),
    ] = None,
) -> None:
    """Compare CANDIDATE with REFERENCE: size, accuracy, per-layer error, latency per provider; judge gates.

    Exit code 1 when any gate fails (after printing every gate), 2 on bad input.
    """

    def action() -> None:
        from qtool.api import compare as run_compare
        from qtool.errors import QtoolError
        from qtool.evaluation.gates import check_measurable, parse_gates
        from qtool.evaluation.providers import parse_providers, require_available
        from qtool.graph.input_shapes import parse_input_shapes
        from qtool.graph.model_io import write_text
        from qtool.reports.ci import to_junit, to_markdown
        from qtool.reports.compare_document import comparison_to_dict
        from qtool.reports.documents import to_json
        from qtool.reports.tables import render_comparison

        gates = parse_gates(fail_under, fail_over, min_compression, max_latency_ratio, latency_tolerance)
        check_measurable(gates, runs=runs, task=task, decode_steps=decode_steps)
        chosen = parse_providers(providers)
        if require_providers:
            require_available(chosen)
        # the folder is created with the TensorRT session (qtool.evaluation.providers): after every other check
        using_cache = trt_engine_cache is not None and "TensorrtExecutionProvider" in chosen
        if using_cache and trt_engine_cache is not None and trt_engine_cache.exists() and not trt_engine_cache.is_dir():
            raise QtoolError(f"--trt-engine-cache {trt_engine_cache} is not a directory")
        if plot is not None:
            from qtool.reports.plot import require_matplotlib

            require_matplotlib()
        with progress_bars() as progress:
            options = EvaluationOptions(
                runs=runs,
                warmup=warmup,
                threads=threads,
                limit=limit,
                skip_nonfinite=skip_nonfinite,
                task=task,
                decode_steps=decode_steps,
                per_layer=per_layer or plot is not None,
                providers=tuple(chosen),
                trt_engine_cache=str(trt_engine_cache) if trt_engine_cache is not None else None,
                outputs=tuple(outputs or ()),
            )
            result = run_compare(
                reference,
                candidate,
                data,
                options=options,
                config_path=config,
                gates=gates,
                progress=progress,
                input_shapes=parse_input_shapes(input_shapes) if input_shapes else None,
                baseline=baseline,
                fail_on_regression=fail_on_regression,
            )
        render_comparison(summary_console(json_out), result)
        if json_out:
            write_json(json_out, to_json(comparison_to_dict(result)))
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

    written = {"--json": json_out, "--markdown": markdown, "--junit": junit, "--plot": plot}
    run_command(action, written, (reference, candidate, data, config, baseline))
