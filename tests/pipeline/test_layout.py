"""The shape of the package, as the pipeline issue set it: checked so that it stays that way."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "qtool"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The qtool modules ``path`` imports, lazy imports included (``from pkg import submodule`` names the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("qtool"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            compiled = {a.name for a in node.names if a.name.startswith("_counting")}
            found.update(subs if len(subs) + len(compiled) == len(node.names) else {node.module, *subs})
    return found & set(modules)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_qtool_module_imports_itself_back_through_others():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None


def test_plans_are_built_only_by_the_workspace():
    callers = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "build_plan(" in path.read_text() and path.name != "planner.py"
    }
    assert callers == {"pipeline/workspace.py"}


# package -> the qtool packages it must never import: each floor imports only the floors below it
_ABOVE_OBSERVERS = ("calibration", "quantization", "evaluation", "choice", "pipeline", "reports", "cli")
BELOW_ONLY = {
    "qtool.numerics": ("graph", "observers", *_ABOVE_OBSERVERS),
    "qtool.observers": _ABOVE_OBSERVERS,
    "qtool.quantization": ("evaluation", "choice", "pipeline", "reports", "cli"),
    "qtool.evaluation": ("choice", "pipeline", "reports", "cli"),
    "qtool.choice": ("pipeline", "reports", "cli"),
}


def test_a_package_imports_nothing_from_the_floors_above_it():
    modules = _modules()
    upward = [
        f"{name} imports {imported}"
        for name, path in modules.items()
        for package, above in BELOW_ONLY.items()
        if name.startswith(package + ".")
        for imported in _imports(path, modules)
        if imported.split(".")[1] in above
    ]
    assert upward == []


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_the_api_is_signatures_over_the_pipeline():
    api = PACKAGE / "api.py"
    assert len(api.read_text().splitlines()) <= 250
    assert [name for name, lines in _functions(api) if lines > 40] == []


def test_functions_stay_short_and_commands_are_their_options():
    # no function over 60 lines, a command of cli/ included: its flags come from option groups (cli/groups.py)
    long = [
        f"{path.relative_to(PACKAGE)}:{name} ({lines} lines)"
        for path in PACKAGE.rglob("*.py")
        for name, lines in _functions(path)
        if lines > 60
    ]
    assert long == []


def test_tests_mirror_the_package():
    # a folder per package of qtool/ (config: qtool/config.py with its schemas), plus the four that cross them
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"config"}
    crossing = {"robustness", "golden", "docs", "bench", "fixtures", "plugins"}
    folders = {p.name for p in (PACKAGE.parent / "tests").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert folders - packages - crossing == set()


def test_no_module_is_over_400_lines():
    long = [
        f"{path.relative_to(PACKAGE)} ({len(path.read_text().splitlines())} lines)"
        for path in PACKAGE.rglob("*.py")
        if len(path.read_text().splitlines()) > 400
    ]
    assert long == []


def test_no_function_takes_more_than_eight_parameters_but_the_public_api():
    # the documented entry points (qtool.quantize, qtool.tune, qtool.compare) take their options keyword-only;
    # every other function takes at most 8 (related ones travel as a record), a command of cli/ too: it takes
    # one record per option group (cli/groups.py), and Typer sees the groups' flags
    public = {("api.py", "quantize"), ("api.py", "tune"), ("evaluation/compare.py", "compare")}
    wide = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (where, node.name) not in public:
                given = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if len([a for a in given if a.arg not in ("self", "cls")]) > 8:
                    wide.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert wide == []
