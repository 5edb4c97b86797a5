"""Real third-party models, photos and text from PyPI wheels, cached and checked by SHA-256.

The PP-OCR models ship in ``rapidocr-onnxruntime``; the photos in
``scikit-image``. Calibration and evaluation sets are seeded random crops of
different photos, half of them of the scanned page (the upper part for
calibration, the lower part for evaluation), so the two sets are disjoint and
the OCR models see text; crops are resized to each model's input and
normalised the way the model expects.

The text encoder (``text_encoder``: sentence-transformers' paraphrase-MiniLM-L3-v2, a
3-layer BERT with mean pooling, Apache-2.0) and its WordPiece vocabulary ship in
``vital-ai-vitalsigns``. Its samples are ``.npz`` files keyed by the model's inputs
(``input_ids``, ``attention_mask``), real English sentences from the docstrings of the
pinned ``scikit-image`` wheel, tokenized with the model's own vocabulary (BERT basic
tokenization + greedy longest-match-first WordPiece, ``[CLS] ... [SEP]``, padded to a
fixed length); a seeded shuffle puts every third sentence in the evaluation pool (361) and
the rest in the calibration pool (722), so the two sets never share a sentence.

Everything lands in ``$QTOOL_REAL_CACHE`` (default ``~/.cache/qtool-real``).

Usage from code: ``real_model("ppocr_det")`` or ``real_model("text_encoder")`` -> (model path,
calib dir, eval dir).
Raises ``RegistryUnavailable`` when the wheels cannot be downloaded.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
import unicodedata
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("QTOOL_REAL_CACHE", Path.home() / ".cache" / "qtool-real"))
RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
SKIMAGE = "scikit-image==0.26.0"
VITALSIGNS = "vital-ai-vitalsigns==0.1.19"


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


@dataclass(frozen=True)
class TextModel:
    wheel: str  # pip spec of the wheel that ships model and vocabulary
    member: str  # the ONNX file inside the wheel
    sha256: str
    vocab: str  # the WordPiece vocabulary (one token a line) inside the wheel
    vocab_sha256: str
    inputs: tuple[str, ...]  # the model's inputs, the keys of every sample
    seq_len: int  # every sample is padded (or truncated) to this many tokens


TEXT_MODELS = {
    # sentence-transformers/paraphrase-MiniLM-L3-v2 (Apache-2.0): 3 BERT layers, hidden 384, mean pooling
    # inside the graph; outputs the two inputs again, the token embeddings and the sentence embedding.
    "text_encoder": TextModel(
        VITALSIGNS,
        "vital_ai_vitalsigns/models/paraphrase-MiniLM-L3-v2.onnx",
        "b388816f4fe4beccf2106589a786544596eb1385cac0c57c6a4e2a6758215b16",
        "vital_ai_vitalsigns/models/tokenizer/vocab.txt",
        "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
        ("input_ids", "attention_mask"),
        64,
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


# Sentences: the prose of the pinned scikit-image wheel's docstrings (the part before the numpydoc
# sections), split into sentences, deduplicated; SENTENCES_SHA256 pins the whole list.
SENTENCES_SHA256 = "0745925cb9419da9aa8740430ecfa761b11b9a3a5c786b6b59d3005385db9a3a"
_SECTIONS = re.compile(
    r"^\s*(Parameters|Returns|Yields|Raises|See Also|Notes|References|Examples|Attributes|Methods|"
    r"Other Parameters|Warns|Warnings)\s*$"
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_NOT_PROSE = (">>>", "``", "::", "\\", "{", "}", "=", "|", "_", "[", "]", "`", "$", "*", "~", "http")


def _is_prose(sentence: str) -> bool:
    words = sentence.split()
    if not 6 <= len(words) <= 40 or not sentence[0].isupper() or not sentence.endswith("."):
        return False
    if any(token in sentence for token in _NOT_PROSE):
        return False
    return sum(c.isalpha() or c == " " for c in sentence) / len(sentence) > 0.9


def _docstring_sentences(wheel: Path) -> list[str]:
    found: list[str] = []
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if n.endswith(".py") and "/tests/" not in n)
        for name in names:
            for node in ast.walk(ast.parse(archive.read(name))):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                lines = []
                for line in doc.splitlines():
                    if _SECTIONS.match(line):
                        break
                    lines.append(line.strip())
                for paragraph in re.split(r"\n\s*\n", "\n".join(lines)):
                    found += [s for s in _SENTENCE_END.split(" ".join(paragraph.split())) if _is_prose(s)]
    unique: list[str] = []
    seen: set[str] = set()
    for sentence in found:
        if sentence.lower() not in seen:
            seen.add(sentence.lower())
            unique.append(sentence)
    if hashlib.sha256("\n".join(unique).encode()).hexdigest() != SENTENCES_SHA256:
        raise RuntimeError(f"{wheel.name}: the docstring sentences differ from the recorded ones")
    return unique


def _split_sentences() -> tuple[list[str], list[str]]:
    """(calibration, evaluation) sentences: a seeded shuffle, every third one for evaluation."""
    sentences = _docstring_sentences(_wheel(SKIMAGE))
    order = np.random.default_rng(3000).permutation(len(sentences))
    shuffled = [sentences[i] for i in order]
    evaluation = shuffled[::3]
    calibration = [s for i, s in enumerate(shuffled) if i % 3]
    return calibration, evaluation


class WordPiece:
    """BERT's uncased tokenizer: basic tokenization, then greedy longest-match-first WordPiece.

    Basic tokenization: drop control characters, map whitespace to spaces, put spaces around
    CJK ideographs, lowercase, strip accents (NFD, drop combining marks), split on whitespace
    and on every punctuation character.
    """

    def __init__(self, vocab_path: Path, max_chars_per_word: int = 100) -> None:
        tokens = vocab_path.read_text(encoding="utf-8").split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        self.vocab = {token: index for index, token in enumerate(tokens)}
        self.max_chars_per_word = max_chars_per_word
        self.cls, self.sep, self.pad, self.unk = (self.vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]"))

    @staticmethod
    def _is_punctuation(char: str) -> bool:
        code = ord(char)
        if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
            return True
        return unicodedata.category(char).startswith("P")

    @staticmethod
    def _is_cjk(code: int) -> bool:
        return any(
            low <= code <= high
            for low, high in (
                (0x4E00, 0x9FFF),
                (0x3400, 0x4DBF),
                (0x20000, 0x2A6DF),
                (0x2A700, 0x2B73F),
                (0x2B740, 0x2B81F),
                (0x2B820, 0x2CEAF),
                (0xF900, 0xFAFF),
                (0x2F800, 0x2FA1F),
            )
        )

    def _basic(self, text: str) -> list[str]:
        chars = []
        for char in text:
            code = ord(char)
            if code in (0, 0xFFFD):
                continue
            if char in " \t\n\r" or unicodedata.category(char) == "Zs":
                chars.append(" ")
            elif unicodedata.category(char).startswith("C"):
                continue
            elif self._is_cjk(code):
                chars.append(f" {char} ")
            else:
                chars.append(char)
        text = unicodedata.normalize("NFD", "".join(chars).lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words: list[str] = []
        for word in text.split():
            current = ""
            for char in word:
                if self._is_punctuation(char):
                    words += [current, char] if current else [char]
                    current = ""
                else:
                    current += char
            if current:
                words.append(current)
        return words

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > self.max_chars_per_word:
            return [self.unk]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    pieces.append(self.vocab[piece])
                    break
                end -= 1
            if end == start:
                return [self.unk]
            start = end
        return pieces

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return [i for word in self._basic(text) for i in self._wordpiece(word)]

    def encode(self, text: str, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) of ``[CLS] text [SEP]``, truncated or padded to ``length``."""
        ids = [self.cls, *self.tokenize(text)[: length - 2], self.sep]
        input_ids = np.full(length, self.pad, np.int64)
        input_ids[: len(ids)] = ids
        mask = np.zeros(length, np.int64)
        mask[: len(ids)] = 1
        return input_ids, mask


def _token_samples(model: TextModel, sentences: list[str], count: int, out: Path) -> Path:
    if out.exists() and len(list(out.glob("*.npz"))) == count:
        return out
    if count > len(sentences):
        raise ValueError(f"{out.name}: {count} samples asked for, {len(sentences)} sentences available")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = WordPiece(_extract(model.wheel, model.vocab, model.vocab_sha256))
    for i, sentence in enumerate(sentences[:count]):
        input_ids, mask = tokenizer.encode(sentence, model.seq_len)
        feeds = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(input_ids)}
        np.savez(out / f"{i:04d}.npz", **{name: feeds[name] for name in model.inputs})
    return out


def real_text_model(name: str, n_calib: int = 64, n_eval: int = 32) -> tuple[Path, Path, Path]:
    """(model path, calibration dir, evaluation dir) for one of :data:`TEXT_MODELS`."""
    model = TEXT_MODELS[name]
    path = _extract(model.wheel, model.member, model.sha256)
    base = CACHE / "data" / name
    calib_dir, eval_dir = base / f"text-calib{n_calib}", base / f"text-eval{n_eval}"
    done = [d.exists() and len(list(d.glob("*.npz"))) == n for d, n in ((calib_dir, n_calib), (eval_dir, n_eval))]
    if not all(done):
        calibration, evaluation = _split_sentences()
        _token_samples(model, calibration, n_calib, calib_dir)
        _token_samples(model, evaluation, n_eval, eval_dir)
    return path, calib_dir, eval_dir


def real_model(
    name: str, n_calib: int = 64, n_eval: int = 32, size: tuple[int, int] | None = None
) -> tuple[Path, Path, Path]:
    """(model path, calibration dir, evaluation dir) for one of :data:`MODELS` or :data:`TEXT_MODELS`.

    ``size``: (height, width) of the crops instead of the model's usual input (models with dynamic sizes).
    """
    if name in TEXT_MODELS:
        return real_text_model(name, n_calib, n_eval)
    model = MODELS[name]
    path = _extract(RAPIDOCR, model.member, model.sha256)
    base = CACHE / "data" / name
    tag = ""
    if size is not None:
        model, tag = replace(model, height=size[0], width=size[1]), f"-{size[0]}x{size[1]}"
    calib = _crops(CALIB_PHOTOS, model, n_calib, 1000, base / f"text-calib{n_calib}{tag}", "top")
    evaluation = _crops(EVAL_PHOTOS, model, n_eval, 2000, base / f"text-eval{n_eval}{tag}", "bottom")
    return path, calib, evaluation


if __name__ == "__main__":
    for key in [*MODELS, *TEXT_MODELS]:
        print(key, *real_model(key))
