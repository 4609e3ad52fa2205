"""The code's layout: imports drawn from the source show no circle, go only from a
subpackage to those below it in the data flow, sit at module top (none hidden in functions), and
every package is installed by pyproject.toml."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "specache_cli", "profiles")
# the data flow, bottom to top: a module may import its own layer and those before it
LAYERS = [
    {"engine", "engine.errors", "engine.config", "engine.paths", "engine.machine"},
    {"engine.native"},
    {"engine.backends"},
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


MAX_FUNCTION_LINES, MAX_PARAMETERS, MAX_ENGINE_FILE_LINES = 60, 8, 400
LONG_FILES = {"engine/native/guide_kernels.c"}  # the per-ISA guided kernels, one translation unit


def is_cli_command(node: ast.FunctionDef) -> bool:
    """A Typer command: its options are its parameters (a default typer.Option / typer.Argument, or a group)."""
    return any(isinstance(d, ast.Call) and ast.unparse(d.func).startswith("typer.")
               for d in node.args.defaults + node.args.kw_defaults if d is not None)


def test_functions_and_files_stay_small():
    """No function over 60 lines; none over 8 parameters (self and cls not counted) but Typer commands and
    Triton kernels (a launch's calling convention); no engine source file over 400 lines but LONG_FILES."""
    found = []
    for pkg in ("engine", "specache_cli"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    found.append(f"{where}: {node.end_lineno - node.lineno + 1} lines")
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                kernel = any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)
                if len(names) > MAX_PARAMETERS and not kernel and not is_cli_command(node):
                    found.append(f"{where}: {len(names)} parameters")
    for path in (ROOT / "engine").rglob("*"):
        rel = str(path.relative_to(ROOT))
        if path.suffix in (".py", ".c", ".h") and rel not in LONG_FILES:
            if len(path.read_text().splitlines()) > MAX_ENGINE_FILE_LINES:
                found.append(f"{rel}: {len(path.read_text().splitlines())} lines")
    assert not found, "\n".join(found)


def test_every_cache_mode_is_a_registered_policy():
    """A policy is one module of engine/kvcache/policies/, found by the registry's discovery and
    registered by name; nothing else lists the names: the planner's columns are the registered
    policies that have one, and each policy declares what the jobs and the planner ask of it."""
    from engine.kvcache import POLICIES
    from engine.kvcache.registry import listed
    from engine.plan.planner import plan_columns

    modules = sorted(p.stem for p in (ROOT / "engine" / "kvcache" / "policies").glob("*.py") if p.stem != "__init__")
    assert sorted(cls.__module__.rsplit(".", 1)[1] for cls in POLICIES.values()) == modules  # one policy a module
    assert [listed(cls) for cls in POLICIES.values()] == sorted(listed(cls) for cls in POLICIES.values())
    columns = [name for name, cls in POLICIES.items() if cls.plan_column]
    assert sorted(plan_columns()) == sorted(columns) and list(plan_columns())[0] == next(
        name for name, cls in POLICIES.items() if not cls.guided)  # the exact cache first: the speedup's base
    for name, cls in POLICIES.items():
        assert cls.policy == name and cls.plan_mode in plan_columns() and isinstance(cls.fetches, bool)
        assert not cls.__abstractmethods__  # every hook of CacheLayer defined


def test_a_policy_that_leaves_a_hook_undefined_is_refused_when_defined():
    """CacheLayer is abstract: a policy class without one of its @abstractmethod hooks (or, with a plan
    column, without its memory rule) is refused by register when its module is imported."""
    from engine.kvcache.base import CacheLayer
    from engine.kvcache.registry import POLICIES, register

    def hook(self, *args):
        return None

    class NoAttend(CacheLayer):  # every hook but attend
        update = copy_row = export_row = device_bytes = allocated_device_bytes = hook

    with pytest.raises(TypeError, match="does not define attend"):
        register("holed")(NoAttend)
    with pytest.raises(TypeError, match="abstract"):
        NoAttend()

    class Unsized(NoAttend):
        attend = hook

    with pytest.raises(TypeError, match="has a plan column but no plan_sizing"):
        register("unsized")(Unsized)
    assert "holed" not in POLICIES and "unsized" not in POLICIES


def test_no_mode_name_outside_its_policy():
    """The modes' names are written only in their own modules: no list of them and no branch on one
    anywhere else in the engine and the CLI (the defaults of flags excepted, and the benches, whose
    columns are compared with the reference's, "full", and the default's, "specache")."""
    from engine.kvcache import POLICIES

    names = tuple(POLICIES)
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


PROBE = '''"""A test's policy: kivi's cache under its own name, every declaration inherited."""
from engine.kvcache.policies.kivi import KiviLayer
from engine.kvcache.registry import register


@register("probe")
class ProbeLayer(KiviLayer):
    summary = "a test's policy"
'''

PROBE_CHILD = '''
import json
import sys

import torch
from typer.testing import CliRunner

import engine
from engine.bench.common import parse_mode
from engine.config import CacheConfig
from engine.errors import BadArgument
from engine.kvcache import make_cache, policy
from engine.kvcache.registry import describe
from engine.plan.planner import plan, plan_columns, plan_for_run
from engine.plan.profiles import load_hardware, load_model_profile
from specache_cli.app import app
from tests.conftest import make_tiny_model

out = {"engine": engine.__file__, "describe": describe(), "columns": list(plan_columns())}
cls = policy("probe")
try:
    policy("nope")
except BadArgument as exc:
    out["unknown"] = str(exc)
p = plan(load_hardware("l4"), load_model_profile("smollm2-135m"), 8192)
out["plan"] = [p.mode("probe").device_bytes_per_sequence == p.mode("kivi").device_bytes_per_sequence,
               p.mode("probe").k, p.mode("probe").bits == p.bits]
out["run_column"] = plan_for_run(load_model_profile("smollm2-135m"), 4096, cls, hardware=load_hardware("l4")).mode
out["label_k"] = parse_mode("probe-1b").config.k
out["label_errors"] = []
for label in ("probe-k64", "probe-w64"):
    try:
        parse_mode(label)
    except BadArgument as exc:
        out["label_errors"].append(str(exc))
config = CacheConfig(mode="probe", k=0, residual=16, group=32)
with make_cache(make_tiny_model().config, config, 1, 256, torch.float32, torch.device("cpu")) as cache:
    out["layers"] = sorted({type(layer).__name__ for layer in cache.layers})
    out["stats_mode"] = cache.stats()["mode"]
cli = CliRunner()
out["help"] = cli.invoke(app, ["summarize", "--help"], env={"COLUMNS": "300"}).stdout
r = cli.invoke(app, ["plan", "--gpu", "l4", "--model", "smollm2-135m", "--context", "8192", "--json"])
out["plan_cli"] = [m["mode"] for m in json.loads(r.stdout)["modes"]] if r.exit_code == 0 else r.stderr
runs = {}
for mode in ("probe", "kivi", "probe"):
    r = cli.invoke(app, ["ask", "--doc", sys.argv[1], "What is it about?", "--model", sys.argv[2], "--cache", mode,
                         "--max-tokens", "6", "--json", "--quiet", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    runs.setdefault(mode, []).append(json.loads(r.stdout))
out["runs"] = runs
r = cli.invoke(app, ["cache", "ls", "--json"])
out["store"] = json.loads(r.stdout)["entries"]
print(json.dumps(out))
'''


def test_adding_a_policy_is_one_module(tmp_path, tiny_model_dir):
    """A new policy is one new file in engine/kvcache/policies/: in a copy of the package with that
    file added (nothing else edited), discovery registers it and it is a mode everywhere: the mode
    check and --cache's help, `specache plan`'s columns (sized by its inherited memory rule), a run's
    batch plan, the bench labels, the cache it builds, and a run through the CLI whose answer equals
    kivi's and whose document is stored (and found again) under its own mode."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for package in ("engine", "specache_cli", "profiles", "tests"):
        shutil.copytree(ROOT / package, copy / package, ignore=ignore)
    (copy / "engine" / "kvcache" / "policies" / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(copy), "SPECACHE_CACHE_DIR": str(tmp_path / "store"), "SPECACHE_NATIVE": "0"}
    r = subprocess.run([sys.executable, "-c", PROBE_CHILD, str(ROOT / "tests" / "data" / "sample.txt"),
                        str(tiny_model_dir)], cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["engine"].startswith(str(copy))  # the copy's package, with the new file, was the one run
    assert out["describe"].endswith("exact (specache drafts, the exact store verifies: the output of full) "
                                    "or probe (a test's policy)")
    assert "probe (a test's policy)" in out["help"]
    assert out["unknown"].endswith("exact, probe, not 'nope'")
    assert out["columns"] == ["full", "kivi", "probe", "specache", "exact"]  # kivi's declarations: beside it
    assert out["plan_cli"] == out["columns"]
    assert out["plan"] == [True, 0, True] and out["run_column"] == "kivi"  # a run is sized by the column it names
    assert out["label_k"] == 0  # kivi's fixed k, inherited
    assert "probe never fetches (k = 0)" in out["label_errors"][0] and "w<n> only applies to window" in \
        out["label_errors"][1]
    assert out["layers"] == ["ProbeLayer"] and out["stats_mode"] == "probe"
    probe, kivi = out["runs"]["probe"], out["runs"]["kivi"]
    assert probe[0]["text"] == kivi[0]["text"] == probe[1]["text"]
    assert probe[0]["store"]["hit"] is False and probe[1]["store"]["hit"] is True
    assert probe[0]["store"]["key"] == probe[1]["store"]["key"] != kivi[0]["store"]["key"]
    assert sorted(e["mode"] for e in out["store"]) == ["kivi", "probe"]


# The modules outside engine/backends that may test for CUDA or call torch.cuda themselves, and why: each finds
# out what the machine is or which device a flag names, none chooses code for a device (the backends do).
CUDA_ALLOWED = {
    "engine/plan/hardware.py": "hardware detection: the GPU's name, memory and bus bandwidth",
    "engine/plan/profiles.py": "the built-in hardware profile matching torch.cuda's device name",
    "engine/plan/profile_types.py": "a hardware profile's kind and CUDA names",
    "engine/plan/roofline.py": "the planner's model of a machine kind (a profile's, not a device's)",
    "engine/plan/planner.py": "the planner's model of a machine kind (a profile's, not a device's)",
    "engine/jobs/workers.py": "Ray's GPU placement for --device cuda",
}
CUDA_BRANCH = re.compile(r'^\s*(import triton|from triton)|torch\.cuda\b|[=!]= "cuda"|startswith\("cuda"\)|\.is_cuda\b',
                         re.M)


def test_only_the_backends_branch_on_cuda_or_import_triton():
    """No module outside engine/backends imports Triton or branches on a CUDA device (`device.type == "cuda"`,
    torch.cuda, `.is_cuda`) but CUDA_ALLOWED's; they ask the device's backend (engine.backends.kernels) or its
    streams (engine.backends.streams) instead."""
    found = set()
    for pkg in ("engine", "specache_cli"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith("engine/backends/") and CUDA_BRANCH.search(path.read_text()):
                found.add(rel)
    assert found <= set(CUDA_ALLOWED), sorted(found - set(CUDA_ALLOWED))
    assert found == set(CUDA_ALLOWED), f"no longer testing for CUDA (drop them): {sorted(set(CUDA_ALLOWED) - found)}"
