"""The Python API takes feeds from code (iterables, CalibrationDataReader-shaped readers) and configs as dicts."""

from __future__ import annotations

import numpy as np
import pytest

import qtool
from qtool.errors import QtoolError
from qtool.options import EvaluationOptions
from tests.conftest import calib_dir, eval_dir, sample


def _feeds(directory, limit=None):
    return [{"input": np.load(path)[None]} for path in sorted(directory.glob("*.npy"))[:limit]]


class Reader:
    """onnxruntime's CalibrationDataReader shape."""

    def __init__(self, feeds):
        self.it = iter(feeds)

    def get_next(self):
        return next(self.it, None)


def test_feeds_from_code_give_the_same_model_as_the_directory_they_came_from(tmp_path):
    config = {"global": {"placement": "integer"}, "calibration": {"observer": "minmax"}}
    written = {}
    sources = {
        "directory": calib_dir("mlp"),
        "list": _feeds(calib_dir("mlp")),
        "generator": (feed for feed in _feeds(calib_dir("mlp"))),
        "reader": Reader(_feeds(calib_dir("mlp"))),
    }
    for name, source in sources.items():
        out = tmp_path / f"{name}.onnx"
        qtool.quantize(sample("mlp"), out, config_path=config, data_dir=source, search=None, evaluation=None)
        written[name] = out.read_bytes()
    assert len(set(written.values())) == 1  # byte-identical whatever held the samples
    stats = qtool.calibrate(sample("mlp"), Reader(_feeds(calib_dir("mlp"), 8)))
    assert stats.samples == 8
    report = qtool.compare(
        sample("mlp"), tmp_path / "list.onnx", _feeds(eval_dir("mlp"), 4), options=EvaluationOptions(runs=0)
    )
    assert report.samples == 4 and min(o.sqnr_db for o in report.outputs) > 25


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"input": np.zeros((1, 64), np.float32)}, "got a single dict"),
        ([np.zeros((1, 64), np.float32)], "feed 1 is a ndarray, not a mapping of input names to arrays"),
        ([], "the feeds given hold no sample"),
        (42, "expected a directory, an iterable of feeds or a reader with get_next(), got int"),
    ],
)
def test_feeds_that_are_not_feeds_are_refused_clearly(tmp_path, source, message):
    with pytest.raises(QtoolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        qtool.calibrate(sample("mlp"), source)


def test_a_config_dict_is_validated_like_a_file():
    with pytest.raises(QtoolError, match=r"<config mapping>.*global\.weight\.dtype"):
        qtool.inspect(sample("mlp"), config_path={"global": {"weight": {"dtype": "int3"}}})
    rows = qtool.inspect(sample("mlp"), config_path={"global": {"weight": {"dtype": "int4"}}}).rows
    assert {r.weight.split()[0] for r in rows if r.weight != "-"} == {"int4"}
