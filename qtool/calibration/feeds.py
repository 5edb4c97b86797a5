"""Data from code: feeds held in Python become a sample directory the dataset reads like any other.

The Python API takes, wherever it takes a sample directory, an iterable of feeds (dicts of input
name -> numpy array, one sample or batch each) or an object shaped like onnxruntime's
``CalibrationDataReader`` (``get_next()`` returning a feed, then None). They are written once,
as ``.npz`` files, into a temporary directory that lives for the call: every pass qtool makes
over the data (SmoothQuant and AWQ ranges, calibration, the placement choice, the comparison)
then reads the same samples, and a one-shot generator is enough.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from qtool.calibration.remote import is_url, local_copy
from qtool.errors import QtoolError


@runtime_checkable
class FeedReader(Protocol):
    """onnxruntime's CalibrationDataReader shape: ``get_next()`` gives a feed, then None."""

    def get_next(self) -> Mapping[str, np.ndarray] | None: ...


DataSource = Path | str | Iterable[Mapping[str, np.ndarray]] | FeedReader


def _feeds(source: Iterable[Mapping[str, np.ndarray]] | FeedReader) -> Iterator[Mapping[str, np.ndarray]]:
    if isinstance(source, FeedReader):
        while (feed := source.get_next()) is not None:
            yield feed
        return
    yield from source


@contextlib.contextmanager
def sample_directory(source: DataSource | None, what: str = "data") -> Iterator[Path | str | None]:
    """A directory holding ``source``'s samples: the folder itself, a URL's local copy, or in-memory feeds written out.

    URLs: see :mod:`qtool.calibration.remote`.

    Raises:
        QtoolError: an item is not a mapping of input names to arrays, or there is none.
    """
    if is_url(source):
        with local_copy(cast(str, source)) as directory:
            yield directory
        return
    if source is None or isinstance(source, str | Path):
        yield source
        return
    if isinstance(source, Mapping | np.ndarray):
        raise QtoolError(
            f"{what}: expected a directory, an iterable of feeds or a reader with get_next(), "
            f"got a single {type(source).__name__}",
            hint="wrap one feed in a list: [{'input': array}]",
        )
    if not isinstance(source, FeedReader | Iterable):
        raise QtoolError(
            f"{what}: expected a directory, an iterable of feeds or a reader with get_next(), "
            f"got {type(source).__name__}"
        )
    feeds = cast(Iterable[Mapping[str, np.ndarray]] | FeedReader, source)  # not a path: handled above
    with tempfile.TemporaryDirectory(prefix="qtool-feeds-") as directory:
        count = 0
        for count, feed in enumerate(_feeds(feeds), start=1):
            arrays: dict[str, Any] = _checked(feed, count, what)
            np.savez(Path(directory) / f"sample_{count:06d}.npz", **arrays)
        if count == 0:
            raise QtoolError(f"{what}: the feeds given hold no sample")
        yield Path(directory)


def _checked(feed: Any, index: int, what: str) -> dict[str, np.ndarray]:
    if not isinstance(feed, Mapping) or not feed:
        raise QtoolError(
            f"{what}: feed {index} is a {type(feed).__name__}, not a mapping of input names to arrays",
            hint="yield dicts such as {'input': array}",
        )
    arrays = {}
    for name, value in feed.items():
        if not isinstance(name, str):
            raise QtoolError(f"{what}: feed {index} has a key {name!r} that is not an input name")
        array = np.asarray(value)
        if array.dtype == object:
            raise QtoolError(f"{what}: feed {index}, input '{name}' is not a numeric array")
        arrays[name] = array
    return arrays
