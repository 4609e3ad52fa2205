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
    {"engine", "engine.errors", "engine.config", "engine.paths", "engine.machine"},
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
    """A policy is one module registered by name; nothing else lists the names: the planner's columns
    are the registered policies that have one, and each policy declares what the jobs and the planner
    ask of it."""
    from engine.kvcache import POLICIES
    from engine.plan.planner import plan_columns

    assert list(POLICIES) == ["full", "specache", "kivi", "window", "exact"]  # --cache's order
    assert list(plan_columns()) == ["full", "kivi", "specache", "exact"]  # `specache plan`'s columns
    for name, cls in POLICIES.items():
        assert cls.policy == name and cls.plan_mode in plan_columns() and isinstance(cls.fetches, bool)


def test_no_mode_name_outside_its_policy():
    """The modes' names are written only in their own modules: no list of them and no branch on one
    anywhere else in the engine and the CLI (the defaults of flags excepted, and the benches, whose
    columns are compared with the reference's, "full", and the default's, "specache")."""
    names = ("full", "specache", "kivi", "window", "exact")
    found = []
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "specache_cli").rglob("*.py")]:
        if path.parent.name == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                if sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) > 1:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: a list of modes")
            elif isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in names
                                                       for c in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: a branch on a mode's name")
    assert not found, "\n".join(found)


@pytest.fixture
def probe_policy():
    """A new policy added as a module would add it: one class and its registration (undone after)."""
    from engine.kvcache.kivi import KiviLayer
    from engine.kvcache.registry import POLICIES, register

    @register("probe")
    class ProbeLayer(KiviLayer):  # kivi's layer under its own name: every declaration inherited
        summary = "a test's policy"

    yield ProbeLayer
    del POLICIES["probe"]


def test_adding_a_policy_is_one_module(probe_policy, tiny_model):
    """A registered class is a mode everywhere: the config and the flag check take it, --cache's help
    and `specache plan` list it, the planner sizes it from its declarations, the bench labels and
    the document store's key follow them, and the engine runs it."""
    import json

    import torch
    from typer.testing import CliRunner

    from engine.bench.common import parse_mode
    from engine.config import CacheConfig, GenerationConfig
    from engine.errors import BadArgument
    from engine.generate.engine import Engine, Finished
    from engine.generate.prefixes import store_settings
    from engine.kvcache import make_cache, policy
    from engine.kvcache.registry import describe
    from engine.plan.planner import plan, plan_columns, plan_for_run
    from engine.plan.profiles import load_hardware, load_model_profile
    from specache_cli.app import app

    assert policy(CacheConfig(mode="probe").mode) is probe_policy
    with pytest.raises(BadArgument, match="exact, probe, not 'nope'"):
        policy("nope")
    assert describe().endswith("exact (specache drafts, the exact store verifies: the output of full) "
                               "or probe (a test's policy)")
    assert list(plan_columns()) == ["full", "kivi", "probe", "specache", "exact"]  # kivi's flags: beside it
    p = plan(load_hardware("l4"), load_model_profile("smollm2-135m"), 8192)
    assert p.mode("probe").device_bytes_per_sequence == p.mode("kivi").device_bytes_per_sequence
    assert p.mode("probe").k == 0 and p.mode("probe").bits == p.bits
    assert plan_for_run(load_model_profile("smollm2-135m"), 4096, probe_policy,
                        hardware=load_hardware("l4")).mode == "kivi"  # a run is sized by the column it names
    r = CliRunner().invoke(app, ["plan", "--gpu", "l4", "--model", "smollm2-135m", "--context", "8192", "--json"])
    assert r.exit_code == 0 and "probe" in [m["mode"] for m in json.loads(r.stdout)["modes"]]
    assert parse_mode("probe-1b").config.k == 0  # kivi's fixed k, inherited
    with pytest.raises(BadArgument, match=r"probe never fetches \(k = 0\)"):
        parse_mode("probe-k64")
    with pytest.raises(BadArgument, match="w<n> only applies to window"):
        parse_mode("probe-w64")

    config = CacheConfig(mode="probe", k=0, residual=16, group=32)
    with make_cache(tiny_model.config, config, 1, 256, torch.float32, torch.device("cpu")) as cache:
        assert all(type(layer) is probe_policy for layer in cache.layers)
        assert cache.stats()["mode"] == "probe" and cache.stats()["k"] == 0
        assert store_settings(cache, torch.float32, "tiny")["residual"] == 16
    prompt = [[3 + (i * 7) % 300 for i in range(120)]]
    runs = {mode: next(e for e in Engine(tiny_model, CacheConfig(mode=mode, k=0, residual=16, group=32))
                       .generate(prompt, GenerationConfig(max_tokens=8)) if isinstance(e, Finished))
            for mode in ("probe", "kivi")}
    assert runs["probe"].tokens == runs["kivi"].tokens and runs["probe"].cache_stats["mode"] == "probe"
