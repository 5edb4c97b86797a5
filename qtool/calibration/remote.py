"""Datasets behind fsspec URLs (``s3://``, ``gs://``, ``https://``, ``memory://``), read-only.

The sample files a local folder would be read for (``*.npy``, ``*.npz``, images, and the
``input_*.pb`` files of ``test_data_set_*`` folders) are copied into a temporary folder that lives
for the call; the dataset then detects and validates them exactly as a local folder, and errors
name the URL instead of the temporary folder. Nothing is ever written to the URL. fsspec is the
optional ``remote`` extra; ``s3://`` also needs ``s3fs``, ``gs://`` ``gcsfs``, ``https://``
``aiohttp`` (fsspec names the missing package).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from qtool.calibration.dataset import IMAGE_SUFFIXES
from qtool.errors import QtoolError

log = logging.getLogger(__name__)

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
SAMPLE_SUFFIXES = (".npy", ".npz", *IMAGE_SUFFIXES)
INSTALL_HINT = "install the remote extra: pip install 'qtool-onnx[remote]'"


def is_url(text: object) -> bool:
    """Whether ``text`` is a URL (scheme://...) rather than a local path."""
    return isinstance(text, str) and bool(_URL.match(text))


LOCAL_SCHEMES = ("file", "local")  # fsspec's names for this machine's own files


def local_path(url: str) -> Path | None:
    """The local path a ``file://`` (or ``local://``) URL names; None for any other URL.

    Such a dataset is this machine's files: outputs are checked against it like against a plain path.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme.lower() not in LOCAL_SCHEMES:
        return None
    host = parsed.netloc if parsed.netloc not in ("", "localhost") else ""
    return Path(urllib.parse.unquote(host + parsed.path) or "/")


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as e:
        raise QtoolError(f"{url}: dataset URLs need fsspec ({e})", hint=INSTALL_HINT) from e
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec knows the scheme, its backend is not installed
        raise QtoolError(f"{url}: {e}", hint="install the package named above next to qtool") from e
    except ValueError as e:  # an unknown scheme
        raise QtoolError(f"{url}: {e}", hint="use s3://, gs://, https://, memory:// or a local folder") from e


def sample_files(url: str) -> list[tuple[str, str]]:
    """(remote path, path relative to the dataset) of every file a local folder would be read for."""
    fs, root = _filesystem(url)
    try:
        if not fs.isdir(root):
            raise QtoolError(f"data directory not found: {url}" if not fs.exists(root) else f"{url} is not a directory")
        entries = sorted(fs.ls(root, detail=True), key=lambda e: e["name"])
    except (OSError, ValueError) as e:  # permissions, network, a malformed bucket name
        raise QtoolError(f"cannot list {url}: {e}") from e
    found: list[tuple[str, str]] = []
    for entry in entries:
        name = PurePosixPath(entry["name"].rstrip("/")).name
        if name in ("", ".", ".."):
            continue
        if entry["type"] == "directory" and name.startswith("test_data_set_"):
            for inner in sorted(fs.ls(entry["name"], detail=True), key=lambda e: e["name"]):
                inner_name = PurePosixPath(inner["name"].rstrip("/")).name
                if inner["type"] == "file" and inner_name.startswith("input_") and inner_name.endswith(".pb"):
                    found.append((inner["name"], f"{name}/{inner_name}"))
        elif entry["type"] == "file" and PurePosixPath(name).suffix.lower() in SAMPLE_SUFFIXES:
            found.append((entry["name"], name))
    return found


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[Path]:
    """A temporary local folder holding the dataset at ``url``; QtoolErrors inside name the URL."""
    fs, _ = _filesystem(url)
    files = sample_files(url)
    with tempfile.TemporaryDirectory(prefix="qtool-remote-") as directory:
        local = Path(directory)
        sizes = [fs.size(remote) or 0 for remote, _ in files]
        free = shutil.disk_usage(local).free
        if sum(sizes) > free:
            raise QtoolError(
                f"{url}: its samples take {sum(sizes) / 2**30:.1f} GiB, "
                f"{free / 2**30:.1f} GiB is free in {local.parent}",
                hint="point TMPDIR at a larger disk, or use --limit",
            )
        log.info("copying %d files (%.1f MiB) from %s", len(files), sum(sizes) / 2**20, url)
        for remote, relative in files:
            target = local / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get_file(remote, str(target))
            except OSError as e:
                raise QtoolError(f"cannot read {url.rstrip('/')}/{relative}: {e}") from e
        try:
            yield local
        except QtoolError as e:
            _rename(e, local, url)
            raise


def _rename(error: QtoolError, local: Path, url: str) -> None:
    """Replace the temporary folder's path by the URL in ``error``'s message and hint."""

    def swap(text: str) -> str:
        return text.replace(str(local), url.rstrip("/"))

    error.message = swap(error.message)
    error.args = (error.message, *error.args[1:])
    if error.hint:
        error.hint = swap(error.hint)
