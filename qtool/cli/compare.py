"""``qtool compare``: accuracy, latency and gates for CI."""

from __future__ import annotations

from functools import partial

from qtool.cli.app import app
from qtool.cli.compare_options import (
    CandidateArgument,
    CompareEvaluation,
    CompareInputs,
    Gates,
    ReferenceArgument,
    Reports,
    compare_action,
)
from qtool.cli.groups import option_groups
from qtool.cli.run import run_command


@app.command()
@option_groups
def compare(
    reference: ReferenceArgument,
    candidate: CandidateArgument,
    inputs: CompareInputs,
    evaluation: CompareEvaluation,
    reports: Reports,
    gates: Gates,
) -> None:
    """Compare CANDIDATE with REFERENCE: size, accuracy, per-layer error, latency per provider; judge gates.

    Exit code 1 when any gate fails (after printing every gate), 2 on bad input.
    """
    action = partial(compare_action, reference, candidate, inputs, evaluation, reports, gates)
    written = {
        "--json": reports.json_out,
        "--markdown": reports.markdown,
        "--junit": reports.junit,
        "--plot": evaluation.plot,
    }
    run_command(action, written, (reference, candidate, inputs.data, inputs.config, gates.baseline))
