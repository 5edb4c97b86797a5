"""The README's examples run as printed, and every qtool flag it mentions exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer

from qtool.cli import app
from tests.conftest import ROOT, sample

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n".join(path.read_text() for path in DOCUMENTS)  # the README and the pages it links to
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
YAML_BLOCKS = re.findall(r"```yaml\n(.*?)```", README, flags=re.DOTALL)
COMMAND = typer.main.get_command(app)


def _options(command: typer.core.TyperCommand | typer.core.TyperGroup) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")}


COMMANDS: dict[str, set[str]] = {  # what each command's --help lists, with the global options
    name: _options(command) | _options(COMMAND) | {"--help"}
    for name, command in COMMAND.commands.items()  # type: ignore[attr-defined]
}
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_NAMED = re.compile(r"(" + "|".join(COMMANDS) + r") ")
# lines about other programs: their flags are not qtool's
_OTHER_TOOLS = re.compile(r"bench/|\bmake\b|\bpip\b|\bpytest\b|\bpython\b|\buv\b|\bdask\b|trtexec|onnxruntime's")


def test_the_readme_is_short_enough_to_read_in_five_minutes():
    assert len((ROOT / "README.md").read_bytes()) < 14_000


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[f"yaml{i}" for i in range(len(YAML_BLOCKS))])
def test_yaml_config_examples_are_valid_configs(tmp_path, block):
    from qtool.config import load_config

    config = tmp_path / "example.yaml"
    config.write_text(block)
    load_config(config)  # raises QtoolError naming the line if an example drifted from the schema


def test_relative_links_in_the_readme_and_docs_resolve():
    broken = []
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_the_readme_has_a_python_example():
    assert PYTHON_BLOCKS, "the README's 'Using it from Python' block is gone"


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_blocks_run_on_the_sample_model(tmp_path, block):
    """Each block runs in a folder where model.onnx, calib/ and eval/ are the sample CNN's (and sample_models/ is)."""
    cnn = sample("cnn")
    (tmp_path / "sample_models").symlink_to(cnn.parent.parent)
    (tmp_path / "model.onnx").symlink_to(cnn)
    (tmp_path / "calib").symlink_to(cnn.parent / "calib")
    (tmp_path / "eval").symlink_to(cnn.parent / "eval")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the example prints its results"


def _mentions() -> list[tuple[int, str, str | None]]:
    """(line number, flag, command) for every ``--flag`` in the README's code that belongs to qtool.

    A flag belongs to the command named in the same code span or command line (``qtool quantize ...``,
    ```quantize --stats```), else to the command whose section it is in, else to any command.
    """
    found = []
    section: str | None = None
    fenced = False
    for number, line in enumerate(README.splitlines(), 1):  # numbers count through README then docs/
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced and line.startswith("#"):
            heading = re.search(r"`qtool (\w+)", line)
            section = heading.group(1) if heading else None
            continue
        spans = [line] if fenced else re.findall(r"`([^`]*)`", line)
        for span in spans:
            if _OTHER_TOOLS.search(span) and "qtool " not in span:
                continue
            named = _NAMED.match(span) or re.search(r"qtool (\w+)", span)
            command = named.group(1) if named and named.group(1) in COMMANDS else section
            found.extend((number, flag, command) for flag in _FLAG.findall(span))
    return found


def test_every_flag_the_readme_mentions_exists():
    every = set().union(*COMMANDS.values())
    missing = [
        f"README.md:{number}: {flag} ({command or 'any command'})"
        for number, flag, command in _mentions()
        if flag not in (COMMANDS[command] if command else every)
    ]
    assert not missing, "\n".join(missing)


def test_no_document_installs_someone_elses_qtool_from_the_index():
    """'qtool' on the package index is an unrelated project: ours is qtool-onnx."""
    documents = [ROOT / "README.md", *sorted((ROOT / "examples").iterdir()), ROOT / "Makefile", ROOT / ".ci" / "run"]
    documents += sorted((ROOT / "qtool").rglob("*.py"))
    wrong = re.compile(r"pip3? install[^\n]*?(?<![\w./-])['\"]?qtool(\[[^\]]*\])?['\"]?(?=[\s'\"]|$)")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in documents
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if wrong.search(line) or re.search(r"['\"]qtool(\[[^\]]*\])? @", line)
    ]
    assert not offenders, "\n".join(offenders)
    assert 'name = "qtool-onnx"' in (ROOT / "pyproject.toml").read_text()


def test_the_flag_check_reads_real_options():
    assert {"--stats", "--data", "--opset", "--output"} <= COMMANDS["quantize"]
    assert "--stats" not in COMMANDS["compare"] and "--no-such-flag" not in set().union(*COMMANDS.values())
