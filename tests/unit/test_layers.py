"""The house's floors: a package imports only the floors below it (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qtool

PACKAGE = Path(qtool.__file__).parent

# package -> the qtool packages it must never import
BELOW_ONLY = {
    "quantization": ("evaluation", "choice", "pipeline", "reports", "cli"),
    "evaluation": ("choice", "pipeline", "cli"),
    "choice": ("pipeline", "cli"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("qtool.")}


@pytest.mark.parametrize("package", sorted(BELOW_ONLY))
def test_a_package_imports_nothing_from_the_floors_above_it(package):
    upward = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in _imports(path):
            above = name.split(".")[1]
            if above in BELOW_ONLY[package]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not upward, upward
