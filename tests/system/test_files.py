"""qtool.system.files: regular files of bounded size, JSON with finite numbers and bounded nesting."""

from __future__ import annotations

import os

import pytest

from qtool.errors import QtoolError
from qtool.system.files import JSON_MAX_DEPTH, check_regular, read_json, read_text


def test_a_regular_file_reports_its_size_and_anything_else_is_named(tmp_path):
    f = tmp_path / "stats.json"
    f.write_bytes(b"{}" * 10)
    assert check_regular(f, "statistics file") == 20
    with pytest.raises(QtoolError, match=r"statistics file .* is a directory; qtool reads regular files only"):
        check_regular(tmp_path, "statistics file")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(QtoolError, match="is a FIFO"):
        read_text(fifo, "config", 100)  # refused from its kind: opening it would block
    with pytest.raises(QtoolError, match="config not found"):
        check_regular(tmp_path / "missing.yaml", "config")


def test_a_file_over_its_limit_is_refused_before_it_is_read(tmp_path):
    f = tmp_path / "big.json"
    f.write_text("[" + "0," * 100 + "0]")
    with pytest.raises(QtoolError, match=r"is 203 bytes, over the 100-byte limit"):
        read_json(f, "report", 100)
    assert read_json(f, "report", 1000) == [0] * 101


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"scale": NaN}', "NaN is not a JSON number"),
        ('{"scale": -Infinity}', "-Infinity is not a JSON number"),
        ('{"scale": 1e400}', "too large for a float"),
        ('{"scale": 1,}', "is not valid JSON"),
    ],
)
def test_json_numbers_must_be_finite_and_the_file_is_named(tmp_path, text, message):
    f = tmp_path / "stats.json"
    f.write_text(text)
    with pytest.raises(QtoolError, match=message) as caught:
        read_json(f, "statistics file", 1000)
    assert str(f) in str(caught.value)


def test_json_nesting_is_bounded_without_exhausting_the_stack(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * (JSON_MAX_DEPTH + 1) + "]" * (JSON_MAX_DEPTH + 1))
    with pytest.raises(QtoolError, match=f"nests deeper than {JSON_MAX_DEPTH} levels"):
        read_json(f, "config", 10_000)
    f.write_text("[" * 100_000 + "]" * 100_000)  # past Python's recursion limit
    with pytest.raises(QtoolError, match="nests deeper"):
        read_json(f, "config", 1_000_000)
    f.write_text("[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH)
    assert read_json(f, "config", 10_000) is not None


def test_text_that_is_not_utf8_names_the_byte(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_bytes(b"global:\n  \xff\xfe")
    with pytest.raises(QtoolError, match=r"is not UTF-8 text \(byte 10\)"):
        read_text(f, "config", 100)
