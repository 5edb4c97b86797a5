"""``quantize --vs-onnxruntime``: onnxruntime's own static quantization of the same file, measured beside."""

from __future__ import annotations

from pathlib import Path

from qtool.calibration.remote import is_url
from qtool.errors import QtoolError
from qtool.evaluation.peer import PeerRun, beside_onnxruntime
from qtool.options import CalibrationOptions, EvaluationOptions
from qtool.pipeline.data import calibration_dataset, full_dataset
from qtool.pipeline.workspace import Workspace
from qtool.schemas.reports.quantize import PeerReport
from qtool.system.stages import stage

PEER_RUNS = 20  # timed rounds per thread setting when the comparison times nothing (--runs 0, or no evaluation)


def check_peer_data(data_dir: Path | str | None) -> None:
    """Refuse ``--vs-onnxruntime`` before any work unless its calibration samples are in a local directory."""
    if data_dir is None or is_url(data_dir):
        raise QtoolError(
            "--vs-onnxruntime needs --data DIR, a local directory: onnxruntime's quantize_static calibrates on it"
        )


def measured_beside_onnxruntime(
    ws: Workspace,
    output_path: Path,
    data_dirs: tuple[Path | str, Path | str | None],
    calibration: CalibrationOptions,
    evaluation: EvaluationOptions | None,
) -> PeerReport:
    """Onnxruntime's model calibrated on the samples qtool calibrated on, scored and timed with qtool's and fp32.

    ``data_dirs``: the calibration samples, and the held-out ones to score on (None: the calibration samples).
    """
    # absolute: onnxruntime reads the calibration samples from inside its scratch directory
    data_dir, eval_dir = (Path(d).resolve() if d is not None else None for d in data_dirs)
    assert data_dir is not None  # check_peer_data refused a missing one
    samples = calibration_dataset(ws, data_dir, calibration, sharded=False)
    options = evaluation or EvaluationOptions()
    run = PeerRun(
        ws.path,
        output_path,
        (feed for _, feed in samples.samples()),
        full_dataset(ws, eval_dir if eval_dir is not None else data_dir),
        held_out=eval_dir is not None,
        runs=options.runs or PEER_RUNS,
        warmup=options.warmup,
    )
    with stage("onnxruntime's quantize_static of the same file, scored and timed beside qtool's model"):
        return beside_onnxruntime(run)
