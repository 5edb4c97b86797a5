"""qtool.system.outputs: outputs checked before work, kept only when the command ends well, inputs never replaced."""

from __future__ import annotations

import os

import pytest

from qtool.errors import QtoolError
from qtool.system.outputs import after_commit, check_outputs, finish, transaction


def _write(path, text):
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    finish(temporary, path)


def test_outputs_of_a_failed_command_are_undone_and_earlier_files_restored(tmp_path):
    kept, new = tmp_path / "report.json", tmp_path / "model.onnx"
    kept.write_text("before")
    ran = []
    with pytest.raises(RuntimeError), transaction():
        _write(kept, "after")
        _write(new, "model")
        after_commit(lambda: ran.append("after"))
        assert kept.read_text() == "after" and new.exists()
        raise RuntimeError("a bug half-way")
    assert kept.read_text() == "before" and not new.exists() and not ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no hidden copy left behind


def test_outputs_of_a_command_that_ends_well_stay_and_the_deferred_actions_run(tmp_path):
    report = tmp_path / "report.json"
    report.write_text("before")
    ran = []
    with transaction():
        _write(report, "after")
        after_commit(lambda: ran.append(report.read_text()))
        assert not ran
    assert report.read_text() == "after" and ran == ["after"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_gate_keeps_its_reports(tmp_path):
    class GateFailed(Exception):
        pass

    report = tmp_path / "report.json"
    with pytest.raises(GateFailed), transaction(keep_on=(GateFailed,)):
        _write(report, "the gate's verdict")
        raise GateFailed
    assert report.read_text() == "the gate's verdict"


def test_an_output_may_not_be_an_input_by_name_link_or_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "000.npy").write_bytes(b"x")
    model = tmp_path / "model.onnx"
    model.write_bytes(b"m")
    os.link(model, tmp_path / "hard.onnx")
    (tmp_path / "soft.onnx").symlink_to(model)
    for output in (model, tmp_path / "hard.onnx", tmp_path / "soft.onnx", data / "000.npy"):
        with pytest.raises(QtoolError, match="qtool never overwrites its inputs"):
            check_outputs({"-o": output}, [model, data])
    check_outputs({"-o": tmp_path / "q.onnx", "--json": None}, [model, data])


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ({"-o": "-"}, "-o - : this output is a file"),
        ({"-o": "{tmp}"}, "is a directory"),
        ({"-o": "{tmp}/missing/q.onnx"}, "folder .*missing does not exist"),
        ({"-o": "{tmp}/q.onnx", "--json": "{tmp}/q.onnx"}, "--json .* is also given as -o"),
    ],
)
def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, outputs, message):
    resolved = {option: path.format(tmp=tmp_path) for option, path in outputs.items()}
    with pytest.raises(QtoolError, match=message):
        check_outputs(resolved, [])
    assert list(tmp_path.iterdir()) == []
