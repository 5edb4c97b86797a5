"""Image preprocessing for calibration from photos: resize, center-crop, scale, normalise, lay out.

Configured by the ``preprocess:`` block of the QConfigDict; anything left out is
derived from the model's input shape (size and layout) or takes the default
below (scale 1/255, no mean/std, RGB, float32).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qtool.errors import QtoolError
from qtool.system.files import check_regular

KEYS = ("resize", "center_crop", "scale", "mean", "std", "channel_order", "layout", "dtype")


@dataclass(frozen=True)
class Preprocess:
    """How one image becomes one model input (without the batch dimension)."""

    resize: tuple[int, int] | int | None = None  # (H, W), or the shorter side keeping the aspect ratio
    center_crop: tuple[int, int] | None = None  # (H, W)
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    channel_order: str = "RGB"
    layout: str = "NCHW"
    dtype: str = "float32"
    channels: int = 3  # 1 reads the image as grayscale

    def describe(self) -> str:
        """What is done to each image, in words (for the notice when no ``preprocess:`` block chose it)."""
        size = (
            f"resized to {self.resize[0]}x{self.resize[1]}"
            if isinstance(self.resize, tuple)
            else f"shorter side resized to {self.resize}"
            if self.resize
            else "not resized"
        )
        crop = f", center-cropped to {self.center_crop[0]}x{self.center_crop[1]}" if self.center_crop else ""
        normalized = (
            "no mean or std"
            if set(self.mean) == {0.0} and set(self.std) == {1.0}
            else f"mean {list(self.mean)}, std {list(self.std)}"
        )
        return (
            f"{size}{crop}, {self.channel_order} {self.layout}, pixels scaled by {self.scale:g}, {normalized}, "
            f"{self.dtype}"
        )

    def apply(self, path: Path) -> np.ndarray:
        """Load ``path`` and return the preprocessed array (C, H, W) or (H, W, C)."""
        from PIL import Image, UnidentifiedImageError

        check_regular(path, "image", IMAGE_MAX_BYTES)
        try:
            with warnings.catch_warnings():
                # Pillow warns above MAX_IMAGE_PIXELS and refuses above twice that: both are refusals here
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(path) as opened:
                    image = opened.convert("L" if self.channels == 1 else "RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise QtoolError(
                f"{path}: image larger than {Image.MAX_IMAGE_PIXELS:,} pixels (Pillow's decompression-bomb limit)"
            ) from e
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise QtoolError(f"{path}: cannot read image: {e}") from e
        if self.resize is not None:
            image = image.resize(self._resize_size(image.size), Image.Resampling.BILINEAR)
        if self.center_crop is not None:
            height, width = self.center_crop
            left, top = (image.width - width) // 2, (image.height - height) // 2
            if left < 0 or top < 0:
                raise QtoolError(
                    f"{path}: image {image.width}x{image.height} is smaller than the crop {width}x{height}",
                    hint="resize it first with preprocess.resize",
                )
            image = image.crop((left, top, left + width, top + height))
        pixels = np.asarray(image, dtype=np.float32)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.channel_order == "BGR":
            pixels = pixels[:, :, ::-1]
        normalised = (pixels * np.float32(self.scale) - np.asarray(self.mean, np.float32)) / np.asarray(
            self.std, np.float32
        )
        if self.layout == "NCHW":
            normalised = normalised.transpose(2, 0, 1)
        if np.issubdtype(np.dtype(self.dtype), np.integer):
            info = np.iinfo(np.dtype(self.dtype))
            normalised = np.clip(np.rint(normalised), info.min, info.max)
        return np.ascontiguousarray(normalised.astype(self.dtype))

    def _resize_size(self, size: tuple[int, int]) -> tuple[int, int]:
        if isinstance(self.resize, int):
            width, height = size
            factor = self.resize / min(width, height)
            return max(1, round(width * factor)), max(1, round(height * factor))
        assert self.resize is not None
        return self.resize[1], self.resize[0]


IMAGE_MAX_BYTES = 1 << 30  # a compressed image file; its pixels are bounded by Pillow's MAX_IMAGE_PIXELS


def _pair(value: Any, what: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return value[0], value[1]
    raise QtoolError(f"preprocess.{what}: expected a positive integer or [height, width], got {value!r}")


MAX_IMAGE_PIXELS = 2**28  # 268 M pixels (16384 x 16384): past this a resized image would not fit in memory


def _check_image_size(resize: tuple[int, int] | int | None, crop: tuple[int, int] | None) -> None:
    """Refuse a resize or crop (the model's input size, or the config's) no memory could hold, before any image."""
    for what, size in (("resize", resize), ("center_crop", crop)):
        if size is None:
            continue
        height, width = (size, size) if isinstance(size, int) else size
        if height * width > MAX_IMAGE_PIXELS:
            raise QtoolError(
                f"images would be resized to {height}x{width} ({what}), more than {MAX_IMAGE_PIXELS:,} pixels",
                hint="check the model's input size (or --input-shapes), and preprocess.resize / center_crop",
            )


def build_preprocess(config: dict[str, Any] | None, shape: tuple[Any, ...], input_dtype: str) -> Preprocess:
    """Combine the configured ``preprocess:`` block with what the model's input shape implies.

    Args:
        config: the ``preprocess:`` mapping (validated keys), or None.
        shape: the model input's shape including the batch dimension.
        input_dtype: the model input's numpy dtype name.
    """
    if len(shape) not in (3, 4):
        dims = ", ".join(str(d) for d in shape)
        raise QtoolError(
            f"images need a model input of rank 4 (N, C, H, W or N, H, W, C) or 3; this one is [{dims}]",
            hint="give samples as .npy/.npz arrays for this model",
        )
    config = dict(config or {})
    layout = config.get("layout")
    if layout is None and len(shape) == 4:
        layout = "NHWC" if shape[3] in (1, 3) and shape[1] not in (1, 3) else "NCHW"
    layout = layout or "NCHW"
    channels = shape[1] if layout == "NCHW" and len(shape) == 4 else shape[3] if len(shape) == 4 else 3
    spatial = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2]) if len(shape) == 4 else (None, None)
    resize: tuple[int, int] | int | None = None
    if "resize" in config:
        value = config["resize"]
        resize = (
            value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else _pair(value, "resize")
        )
    crop = _pair(config["center_crop"], "center_crop") if "center_crop" in config else None
    if resize is None and crop is None and all(isinstance(d, int) for d in spatial):
        resize = (int(spatial[0]), int(spatial[1]))  # type: ignore[arg-type]
    _check_image_size(resize, crop)
    mean = tuple(float(v) for v in config.get("mean", [0.0]))
    std = tuple(float(v) for v in config.get("std", [1.0]))
    if any(s == 0 for s in std):
        raise QtoolError("preprocess.std: values must be non-zero")
    dtype = str(config.get("dtype", input_dtype))
    default_scale = 1.0 if np.issubdtype(np.dtype(dtype), np.integer) else 1.0 / 255.0  # integer inputs take pixels
    return Preprocess(
        resize=resize,
        center_crop=crop,
        scale=float(config.get("scale", default_scale)),
        mean=mean,
        std=std,
        channel_order=str(config.get("channel_order", "RGB")),
        layout=layout,
        dtype=dtype,
        channels=1 if channels == 1 else 3,
    )
