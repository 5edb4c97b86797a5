"""``qtool doctor``: what this machine offers qtool — versions, execution providers, CPU, GPU."""

from __future__ import annotations

import platform
import shutil
import subprocess

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from qtool.graph.opsets import qdq_kernel_opset
from qtool.graph.session import inference_session, runtime_message
from qtool.observers.histogram import counting_kernel
from qtool.schemas.reports.doctor import DoctorProvider, DoctorReport
from qtool.system.environment import cpu_info, int8_kernels_saturate, versions


def _tiny_model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "doctor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _check_provider(name: str) -> DoctorProvider:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = inference_session(_tiny_model(), options, providers=[name])
    except Exception as e:  # noqa: BLE001 - a provider that fails to load is what this reports
        text = runtime_message(str(e)).splitlines()
        return DoctorProvider(name=name, loads=False, detail=text[0] if text else type(e).__name__)
    if name not in session.get_providers():
        fell_back = f"onnxruntime fell back to {', '.join(session.get_providers())}"
        return DoctorProvider(name=name, loads=False, detail=fell_back)
    return DoctorProvider(name=name, loads=True, detail="a session loads")


SMI_MAX_BYTES = 64 << 10  # nvidia-smi -L prints a line per GPU
SMI_MAX_LINES = 64


def _gpus() -> list[str]:
    """NVIDIA GPUs that nvidia-smi lists (empty when there is no driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    # another program's output: bytes that are not UTF-8 are shown as replacement characters, never an error
    text = out.stdout[:SMI_MAX_BYTES].decode("utf-8", errors="replace")
    return [line.strip() for line in text.splitlines() if line.strip()][:SMI_MAX_LINES]


def diagnose() -> DoctorReport:
    """Look at this machine: library versions, providers (each loaded once), CPU flags, GPUs."""
    cpu = cpu_info()
    return DoctorReport(
        versions={
            **versions(),
            "onnx opset": str(onnx.defs.onnx_opset_version()),
            "histogram counting": "compiled kernel" if counting_kernel() else "numpy (the C kernel is not built)",
        },
        system=f"{platform.system()} {platform.release()} ({platform.machine()})",
        cpu=cpu,
        int8_kernels_saturate=int8_kernels_saturate(list(cpu["flags"]), str(cpu["machine"])),
        providers=[_check_provider(name) for name in ort.get_available_providers()],
        qdq_kernel_opsets={
            d: qdq_kernel_opset(d, quantize=d in ("uint8", "int8", "fp8_e4m3"))
            for d in ("uint8", "int8", "int4", "int2", "fp8_e4m3")
        },
        gpus=_gpus(),
    )
