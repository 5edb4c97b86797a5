"""onnxruntime's own static quantization of a model, the recipe most users would otherwise run.

``quant_pre_process`` (shape inference and graph optimization), then ``quantize_static`` in QDQ format
with MinMax calibration, per-channel int8 weights and uint8 activations, fed the samples given. It runs
in a scratch directory (``quant_pre_process`` writes its temporary files into the working directory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import onnx

from qtool.calibration.dataset_types import Feed

RECIPE = "QDQ, MinMax calibration, per-channel int8 weights, uint8 activations"
PER_CHANNEL_OPSET = 13  # DequantizeLinear takes an axis (per-channel scales) from opset 13


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    """Run in ``path``, with warnings onnxruntime's quantizer logs on the root logger held back (its own advice)."""
    here, root = os.getcwd(), logging.getLogger()
    level = root.level
    os.chdir(path)
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
        os.chdir(here)


def _per_channel_opset(source: Path, converted: Path, notes: list[str]) -> Path:
    """``source``, or its conversion to opset 13 written to ``converted`` when older (said in ``notes``).

    onnxruntime writes per-channel DequantizeLinear (its axis) into an older opset as it is, which no runtime
    loads: the model is converted first, as onnxruntime's documentation advises.
    """
    header = onnx.load(str(source), load_external_data=False)
    opset = next((o.version for o in header.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset >= PER_CHANNEL_OPSET:
        return source
    from onnx import version_converter

    onnx.save(version_converter.convert_version(onnx.load(str(source)), PER_CHANNEL_OPSET), converted)
    notes.append(f"converted from opset {opset} to {PER_CHANNEL_OPSET} for onnxruntime's per-channel weights")
    return converted


def quantize_with_onnxruntime(
    model: Path | str,
    feeds: Iterable[Feed],
    out: Path | str,
    *,
    per_channel: bool = True,
    method: str = "MinMax",
    symmetric: bool = False,
) -> list[str]:
    """Write onnxruntime's static quantization of ``model`` (see :data:`RECIPE`) to ``out``; notes on the way.

    ``method`` names a ``CalibrationMethod`` (MinMax, Entropy, Percentile); ``symmetric``: int8 activations and
    weights both symmetric (onnxruntime's recipe for TensorRT). Raises whatever onnxruntime raises when it cannot
    quantize the model: the caller reports it.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> Feed | None:
            return next(self.feeds, None)

    model, out, notes = Path(model).resolve(), Path(out).resolve(), []
    with tempfile.TemporaryDirectory(prefix="qtool-ort-") as scratch, _working_directory(scratch):
        source = Path(scratch) / "preprocessed.onnx"
        try:
            quant_pre_process(str(model), str(source))
        except Exception as e:  # noqa: BLE001 - its symbolic shape inference fails on many models
            source = model
            said = str(e).strip().splitlines()[:1]
            why = f"{type(e).__name__}: {said[0][:200]}" if said else type(e).__name__
            notes.append(f"onnxruntime's quant_pre_process failed ({why}); quantized without it")
        if per_channel:
            source = _per_channel_opset(source, Path(scratch) / "converted.onnx", notes)
        quantize_static(
            str(source),
            str(out),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=getattr(CalibrationMethod, method),
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric else None,
        )
    return notes
