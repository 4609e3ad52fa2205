"""scripts/gpu_check.py's runner on the CPU (no GPU, no torch in the runner): a stage that hangs is killed
by its watchdog and recorded, the next stage runs, the JSON is written after each stage; the default
stages fit the budget; --dry-run writes every figure a device run reports."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_runner", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_hung_stage_is_killed_recorded_and_the_next_runs_after_the_json_was_saved(gpu_check, tmp_path):
    """The hung stage (it started a child of its own, also stopped) is `timeout`; the next stage reads
    gpu_check.json at its start and finds the hung stage's record there: the JSON was written between
    them; its own result is merged after it."""
    marker = tmp_path / "grandchild-alive"
    grandchild = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    hang = python(f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
                  "print('hanging', flush=True); time.sleep(600)")
    check = python("import json, pathlib; out = pathlib.Path(" + repr(str(tmp_path)) + "); "
                   "seen = json.loads((out / 'gpu_check.json').read_text())['stages']; "
                   "(out / 'stages').mkdir(exist_ok=True); "
                   "(out / 'stages' / 'after.json').write_text(json.dumps({'seen': seen, 'runs': [{'mode': 'full', "
                   "'context': 8, 'batch': 2, 'ms_per_step': 4.0, 'tokens_per_s': 500.0, 'overlap': None}]}))")
    stages = [gpu_check.Stage("hang", hang, 2.0), gpu_check.Stage("after", check, 30.0)]
    report = gpu_check.run_stages(stages, tmp_path, budget_s=60.0)
    hung = report["stages"]["hang"]
    assert hung["status"] == "timeout" and hung["seconds"] < 30 and "hanging" in hung["log_tail"]
    assert report["stages"]["after"]["status"] == "ok"
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["results_by_stage"]["after"]["seen"]["hang"]["status"] == "timeout"
    assert saved["results"] == [{"context": 8, "batch": 2, "ms_per_step": 4.0, "tokens_per_s": 500.0,
                                 "speedup_vs_full": 1.0, "overlap": None, "predicted_ms_per_step": None,
                                 "stage": "after", "mode": "full"}]
    import time

    time.sleep(4)
    assert not marker.exists()  # the hung stage's own child went with its process group


def test_a_failing_stage_keeps_its_log_and_an_exhausted_budget_skips_the_rest(gpu_check, tmp_path):
    stages = [gpu_check.Stage("fails", python("import sys; print('boom'); sys.exit(3)"), 30.0),
              gpu_check.Stage("eats", python("import time; time.sleep(60)"), 60.0),
              gpu_check.Stage("late", python("pass"), 30.0)]
    report = gpu_check.run_stages(stages, tmp_path, budget_s=gpu_check.MIN_STAGE_S + 3)
    assert report["stages"]["fails"] | {"seconds": 0} == report["stages"]["fails"] | {
        "status": "failed", "exit_code": 3, "seconds": 0, "log_tail": ["boom"]}
    assert report["stages"]["eats"]["status"] == "timeout" and report["stages"]["eats"]["limit_s"] <= 13
    assert report["stages"]["late"]["status"] == "skipped"
    assert json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["late"]["status"] == "skipped"


def test_the_default_stages_fit_the_budget_and_stage_names_are_checked(gpu_check):
    names = gpu_check.chosen(gpu_check.default_stages())
    assert names[:2] == ["versions", "tests"] and {"graphs", "paper-1bit", "paper-2bit", "triton-fused"} <= set(names)
    assert sum(gpu_check.STAGES[n][0] for n in names) <= gpu_check.DEFAULT_BUDGET_S <= 540
    assert gpu_check.chosen("paper,paper-1bit,triton") == ["paper-full", "paper-1bit", "paper-2bit", "triton-torch",
                                                          "triton-fused"]
    with pytest.raises(SystemExit, match="unknown stage"):
        gpu_check.chosen("versions,nope")
    stages = [gpu_check.Stage(n, [], gpu_check.STAGES[n][0]) for n in names]
    assert "(fits)" in gpu_check.budget_lines(stages, gpu_check.DEFAULT_BUDGET_S)[-1]
    assert "exceeds" in gpu_check.budget_lines(stages, 100)[-1]


def test_the_dry_run_writes_every_figure_and_the_budget(tmp_path):
    out = tmp_path / "gpu"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "gpu_check budget 510 s" in run.stderr and "(fits)" in run.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert all(s["status"] == "ok" for s in report["stages"].values()) and len(report["stages"]) == 8
    rows = {r["stage"]: r for r in report["results"]}
    assert set(rows) == {"paper-full", "paper-1bit", "paper-2bit", "triton-torch", "triton-fused"}
    for row in rows.values():
        assert set(gpu_check_keys()) <= set(row) and row["predicted_ms_per_step"] > 0
    full = rows["paper-full"]["tokens_per_s"]
    assert rows["paper-full"]["speedup_vs_full"] == 1.0
    assert rows["paper-1bit"]["speedup_vs_full"] == round(rows["paper-1bit"]["tokens_per_s"] / full, 3)
    assert "paper-1bit" in run.stdout and "stages: versions ok" in run.stdout


def gpu_check_keys() -> tuple[str, ...]:
    return ("context", "batch", "ms_per_step", "tokens_per_s", "speedup_vs_full", "overlap", "predicted_ms_per_step")
