"""Generated models with large activations, for the cost benchmark (seeded, cached).

- ``audio_stft``: a speech-quality regressor that computes its spectrogram with Convs on
  raw 16 kHz audio (10 s): two 400-tap strided Conv1d (cosine and sine windows, 256 bins,
  hop 160), power and log, three Conv2d over the [256 x 998] spectrogram, pooling and a
  Gemm to three quality scores ``[N, 3]``.
- ``yolo_style``: a YOLOv8-style detector on a 320x320 RGB input: Conv + SiLU (x * Sigmoid(x))
  stages, C2f blocks (a 1x1 Conv, Split in halves, bottlenecks with residual Adds, Concat of every
  branch), an SPPF (three chained 5x5 MaxPools, Concat), an upsampling neck (Resize, Concat with the
  backbone) and a three-scale head whose boxes and sigmoid class scores are concatenated into
  ``[N, 4 + 16, 2100]``, as exported detectors end.
- ``mobilenet_v2_style``: MobileNetV2's inverted residuals as torch exports them (BatchNormalization folded,
  ReLU6 as ``Clip(x, 0, 6)``) on a 224x224 RGB input, pooled into a 100-class Gemm.
- ``detector_800x608``: a detector-sized CNN on an 800x608 RGB input: a strided backbone with
  depthwise-separable blocks, an FPN-style upsampled merge, and two heads — boxes
  ``[N, 7600, 4]`` and sigmoid scores ``[N, 7600, 2]``.

Weights are He-initialised from a fixed seed; samples are smooth random images and sums of
tones in noise. Everything lands in ``$QTOOL_BENCH_CACHE`` (default ``~/.cache/qtool-bench``).
Usage from code: ``generated_model("audio_stft")`` -> (model path, calib dir, eval dir).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CACHE = Path(os.environ.get("QTOOL_BENCH_CACHE", Path.home() / ".cache" / "qtool-bench"))
VERSION = 1  # bump when a generator changes: the cache folder name carries it
CALIB, EVAL = 32, 8


class _Graph:
    """A small builder: nodes, initializers and unique names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, prefix: str, value: np.ndarray) -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], **attrs: object) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "/node", **attrs))
        return out

    def conv(
        self, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1, relu: bool = True, gain: float = 2.0
    ) -> str:
        fan_in = cin // group * k * k
        w = (self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(gain / fan_in)).astype(np.float32)
        b = (self.rng.standard_normal(cout) * 0.05).astype(np.float32)
        y = self.node(
            "Conv",
            [x, self.const("w", w), self.const("b", b)],
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
            group=group,
        )
        return self.node("Relu", [y]) if relu else y

    def model(self, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "generated", inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qtool-bench")
        onnx.checker.check_model(model)
        return model


def _audio_stft() -> tuple[onnx.ModelProto, Callable[[np.random.Generator], np.ndarray]]:
    g = _Graph(7)
    taps, hop, bins, seconds, rate = 400, 160, 256, 10, 16000
    t = np.arange(taps)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * t / taps)
    freqs = np.arange(bins)[:, None] * np.pi / bins
    cos = (np.cos(freqs * t) * window).astype(np.float32)[:, None, :]
    sin = (np.sin(freqs * t) * window).astype(np.float32)[:, None, :]
    real = g.node("Conv", ["audio", g.const("stft_cos", cos)], kernel_shape=[taps], strides=[hop])
    imag = g.node("Conv", ["audio", g.const("stft_sin", sin)], kernel_shape=[taps], strides=[hop])
    power = g.node("Add", [g.node("Mul", [real, real]), g.node("Mul", [imag, imag])])
    log = g.node("Log", [g.node("Add", [power, g.const("eps", np.array(1e-6, np.float32))])])
    x = g.node("Unsqueeze", [log, g.const("axis", np.array([1], np.int64))])  # [N, 1, 256, T]
    x = g.conv(x, 1, 16, 3)
    x = g.conv(x, 16, 32, 3, stride=2)
    x = g.conv(x, 32, 32, 3)
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x])])
    w = (g.rng.standard_normal((3, 32)) * 0.2).astype(np.float32)
    g.nodes.append(
        helper.make_node(
            "Gemm", [x, g.const("head_w", w), g.const("head_b", np.zeros(3, np.float32))], ["quality"], transB=1
        )
    )
    samples = seconds * rate
    model = g.model(
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, samples])],
        [helper.make_tensor_value_info("quality", TensorProto.FLOAT, [1, 3])],
    )

    def sample(rng: np.random.Generator) -> np.ndarray:
        time = np.arange(samples) / rate
        tones = sum(
            rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 4000) * time + rng.uniform(0, 6))
            for _ in range(6)
        )
        return (tones + rng.standard_normal(samples) * 0.02).astype(np.float32)[None, None, :]

    return model, sample


def _detector() -> tuple[onnx.ModelProto, Callable[[np.random.Generator], np.ndarray]]:
    g = _Graph(11)
    height, width = 608, 800
    x = g.conv("image", 3, 16, 3, stride=2)  # 304 x 400
    x = g.conv(x, 16, 32, 3, stride=2)  # 152 x 200
    for channels, stride in ((32, 1), (64, 2), (64, 1)):  # depthwise-separable blocks -> 76 x 100
        cin = 32 if channels == 32 or stride == 2 else channels
        x = g.conv(x, cin, cin, 3, stride=stride, group=cin)
        x = g.conv(x, cin, channels, 1)
    c3 = x
    x = g.conv(x, 64, 128, 3, stride=2)  # 38 x 50
    x = g.conv(x, 128, 128, 3)
    up = g.node("Resize", [x, "", g.const("scales", np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    merged = g.node("Add", [up, g.conv(c3, 64, 128, 1, relu=False)])
    features = g.conv(merged, 128, 64, 3)
    anchors = (height // 8) * (width // 8)

    def head(channels: int, name: str, sigmoid: bool) -> None:
        y = g.conv(features, 64, channels, 1, relu=False)
        y = g.node("Transpose", [y], perm=[0, 2, 3, 1])
        shape = g.const("shape", np.array([1, anchors, channels], np.int64))
        if sigmoid:
            y = g.node("Reshape", [y, shape])
            g.nodes.append(helper.make_node("Sigmoid", [y], [name], name=name + "/sigmoid"))
        else:
            g.nodes.append(helper.make_node("Reshape", [y, shape], [name], name=name + "/reshape"))

    head(4, "boxes", sigmoid=False)
    head(2, "scores", sigmoid=True)
    model = g.model(
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, height, width])],
        [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, anchors, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, anchors, 2]),
        ],
    )

    def sample(rng: np.random.Generator) -> np.ndarray:
        coarse = rng.standard_normal((3, height // 16, width // 16))
        image = np.kron(coarse, np.ones((16, 16))) + rng.standard_normal((3, height, width)) * 0.2
        return image.astype(np.float32)[None]

    return model, sample


GAIN = 2.6


def _yolo_style() -> tuple[onnx.ModelProto, Callable[[np.random.Generator], np.ndarray]]:
    g = _Graph(5)
    size, classes = 320, 16

    def cbs(x: str, cin: int, cout: int, k: int, stride: int = 1) -> str:
        y = g.conv(x, cin, cout, k, stride=stride, relu=False, gain=GAIN)
        return g.node("Mul", [y, g.node("Sigmoid", [y])])  # SiLU as exporters write it

    def c2f(x: str, cin: int, cout: int, blocks: int, shortcut: bool = True) -> str:
        half = cout // 2
        y = cbs(x, cin, cout, 1)
        split = [g.name("split"), g.name("split")]
        g.nodes.append(
            helper.make_node(
                "Split",
                [y, g.const("halves", np.array([half, half], np.int64))],
                split,
                name=split[0] + "/node",
                axis=1,
            )
        )
        branches = list(split)
        for _ in range(blocks):
            z = cbs(cbs(branches[-1], half, half, 3), half, half, 3)
            branches.append(g.node("Add", [branches[-1], z]) if shortcut else z)
        return cbs(g.node("Concat", branches, axis=1), half * len(branches), cout, 1)

    x = cbs("image", 3, 16, 3, stride=2)  # 160
    x = cbs(x, 16, 32, 3, stride=2)  # 80
    x = c2f(x, 32, 32, 1)
    p3 = c2f(cbs(x, 32, 64, 3, stride=2), 64, 64, 2)  # 40
    p4 = c2f(cbs(p3, 64, 128, 3, stride=2), 128, 128, 2)  # 20
    x = cbs(p4, 128, 64, 1)  # SPPF
    pools = [x]
    for _ in range(3):
        pools.append(g.node("MaxPool", [pools[-1]], kernel_shape=[5, 5], pads=[2, 2, 2, 2], strides=[1, 1]))
    p5 = cbs(g.node("Concat", pools, axis=1), 256, 128, 1)
    up = g.node("Resize", [p5, "", g.const("scales", np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    n3 = c2f(g.node("Concat", [up, p3], axis=1), 192, 64, 1, shortcut=False)  # 40
    n4 = c2f(g.node("Concat", [cbs(n3, 64, 64, 3, stride=2), p5], axis=1), 192, 128, 1, shortcut=False)  # 20
    outputs = []
    for feature, channels in ((n3, 64), (n4, 128)):
        box = g.conv(cbs(feature, channels, 32, 3), 32, 4, 1, relu=False)
        cls = g.conv(cbs(feature, channels, 32, 3), 32, classes, 1, relu=False)
        both = g.node("Concat", [box, g.node("Sigmoid", [cls])], axis=1)
        outputs.append(g.node("Reshape", [both, g.const("shape", np.array([1, 4 + classes, -1], np.int64))]))
    anchors = 40 * 40 + 20 * 20
    g.nodes.append(helper.make_node("Concat", outputs, ["detections"], name="detections/concat", axis=2))
    model = g.model(
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("detections", TensorProto.FLOAT, [1, 4 + classes, anchors])],
    )

    def sample(rng: np.random.Generator) -> np.ndarray:
        coarse = rng.uniform(0, 1, (3, size // 16, size // 16))
        image = np.kron(coarse, np.ones((16, 16))) + rng.standard_normal((3, size, size)) * 0.05
        return np.clip(image, 0, 1).astype(np.float32)[None]

    return model, sample


def _mobilenet_v2_style() -> tuple[onnx.ModelProto, Callable[[np.random.Generator], np.ndarray]]:
    g = _Graph(7)
    size = 224
    bounds = [g.const("zero", np.array(0.0, np.float32)), g.const("six", np.array(6.0, np.float32))]

    def conv6(x: str, cin: int, cout: int, k: int = 1, stride: int = 1, group: int = 1, relu6: bool = True) -> str:
        y = g.conv(x, cin, cout, k, stride=stride, group=group, relu=False)
        return g.node("Clip", [y, *bounds]) if relu6 else y  # ReLU6 as torch exports it (BatchNorm folded)

    x, cin = conv6("image", 3, 32, 3, stride=2), 32  # 112
    for expand, cout, stride in ((1, 16, 1), (6, 24, 2), (6, 24, 1), (6, 32, 2), (6, 32, 1), (6, 64, 2), (6, 96, 1)):
        hidden = cin * expand
        y = conv6(x, cin, hidden) if expand != 1 else x
        y = conv6(y, hidden, hidden, 3, stride=stride, group=hidden)
        y = conv6(y, hidden, cout, relu6=False)
        x, cin = (g.node("Add", [x, y]) if stride == 1 and cin == cout else y), cout
    pooled = g.node("Flatten", [g.node("GlobalAveragePool", [conv6(x, cin, 320)])], axis=1)
    weight = (g.rng.standard_normal((100, 320)) * 0.05).astype(np.float32)
    bias = np.zeros(100, np.float32)
    g.nodes.append(
        helper.make_node(
            "Gemm", [pooled, g.const("fc", weight), g.const("fc_bias", bias)], ["logits"], name="fc", transB=1
        )
    )
    model = g.model(
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 100])],
    )

    def sample(rng: np.random.Generator) -> np.ndarray:
        coarse = rng.standard_normal((3, size // 16, size // 16))
        image = np.kron(coarse, np.ones((16, 16))) + rng.standard_normal((3, size, size)) * 0.2
        return image.astype(np.float32)[None]

    return model, sample


GENERATORS = {
    "audio_stft": _audio_stft,
    "detector_800x608": _detector,
    "yolo_style": _yolo_style,
    "mobilenet_v2_style": _mobilenet_v2_style,
}


def generated_model(name: str) -> tuple[Path, Path, Path]:
    """(model, calibration dir, evaluation dir) of a generated model, built once into the cache."""
    folder = CACHE / f"{name}-v{VERSION}"
    model_path, calib, evaluation = folder / "model.onnx", folder / "calib", folder / "eval"
    if not (folder / "complete").exists():
        model, sample = GENERATORS[name]()
        for directory in (calib, evaluation):
            directory.mkdir(parents=True, exist_ok=True)
        onnx.save(model, model_path)
        rng = np.random.default_rng(2024)
        for i in range(CALIB):
            np.save(calib / f"{i:03d}.npy", sample(rng)[0])
        for i in range(EVAL):
            np.save(evaluation / f"{i:03d}.npy", sample(rng)[0])
        (folder / "complete").write_text("ok\n")
    return model_path, calib, evaluation


if __name__ == "__main__":
    for key in GENERATORS:
        print(key, *generated_model(key))
