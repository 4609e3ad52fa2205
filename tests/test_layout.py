"""The code's layout (issue 13): imports drawn from the source show no circle, go only from a
subpackage to those below it in the data flow, sit at module top (none hidden in functions), and
every package is installed by pyproject.toml."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "specache_cli", "profiles")
# the data flow, bottom to top: a module may import its own layer and those before it
LAYERS = [
    {"engine", "engine.errors", "engine.config", "engine.paths"},
    {"engine.native"},
    {"engine.inputs"},
    {"engine.model"},
    {"engine.kvcache"},
    {"engine.docstore"},
    {"engine.plan", "profiles"},
    {"engine.generate"},
    {"engine.jobs"},
    {"engine.bench"},
    {"specache_cli"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(project module imported, whether the import is inside a function) for each import in the file."""
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        out += [(n, id(node) in inside) for n in names if n.split(".")[0] in PACKAGES]
    return out


def layer_of(module: str) -> int:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    assert best is not None, f"{module} is in no layer of tests/test_layout.py"
    return best[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, bool]]]:
    modules = project_modules()
    return {name: imports(path, modules) for name, path in modules.items()}


def test_no_import_circle(graph):
    edges = {m: {t for t, _ in deps if t in graph and t != m} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in edges[m]:
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [m, t]))
            if t not in state:
                visit(t, stack + [m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert len(state) > 40  # the graph really was drawn


def test_imports_follow_the_data_flow(graph):
    upward = [f"{m} -> {t}" for m, deps in graph.items() for t, _ in deps if layer_of(t) > layer_of(m)]
    assert not upward, "imports against the data flow:\n" + "\n".join(upward)


def test_no_project_import_inside_a_function(graph):
    hidden = [f"{m} imports {t} in a function" for m, deps in graph.items() for t, inner in deps if inner]
    assert not hidden, "\n".join(hidden)


def test_every_package_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {module_name(p.parent / "__init__.py") for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert config["package-dir"]["specache_examples"] == "examples" and (ROOT / "examples" / "__init__.py").is_file()


def test_every_cache_mode_is_a_registered_policy():
    """A policy is one module registered by name; the config accepts exactly the registered names, and
    each declares what the jobs and the planner ask of it."""
    from engine.config import CACHE_MODES
    from engine.kvcache import POLICIES
    from engine.plan.planner import MODES

    assert set(CACHE_MODES) == set(POLICIES)
    for name, cls in POLICIES.items():
        assert cls.policy == name and cls.plan_mode in MODES and isinstance(cls.fetches, bool)
