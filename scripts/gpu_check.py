#!/usr/bin/env python
"""One GPU check of specache that fits one device lease: each stage in a child process under a watchdog.

How to run it in one lease (15 minutes, start-up included; the machine has no network):

1. Here, once: carry the wheels the machine lacks in .whl/ (ignored by git; the list and the pip
   command are in ../shared/design/gpu-device.md, "Recipe").
2. One call of the device tool, carry [".whl"], timeout_s 600, this command:

       SITE=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
         && export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1; python3 -m engine.native; \
         python3 scripts/gpu_check.py --out "$OUT/gpu"

   The default stages finish within --budget-s (510 s: printed at the start, stage by stage); the
   install and the native build take about a minute more. Copy $OUT/gpu into bench-results/gpu/.
3. A second, shorter call fits in what is left: `--stages paper-1bit,triton-fused --budget-s 200`.

Stages (the default ones first, in their order; --stages picks any, in the order given; `paper` is
paper-full,paper-1bit,paper-2bit and `triton` is triton-torch,triton-fused):

- versions: torch, its CUDA, triton, transformers, the GPU, the git commit.
- tests: the CUDA tests (SPECACHE_TEST_DEVICE=cuda): the fused Triton decode, the guide kernels, the
  stand-in's engine tests on real streams, transfer, graphs, verification stream, engine; the log in
  OUT/tests.log, the counts so far even when stopped.
- graphs: full, specache (speculative, the GPU default) and prefetch current at 4k, batch 2, eager and
  replayed as CUDA graphs (SPECACHE_CUDA_GRAPHS=1).
- paper-full, paper-1bit, paper-2bit: the paper's setting, a random-weight model of Llama-3-8B's shape
  (fp16) at --context tokens (32k) under --budget-gb (48 GB), each at the planner's batch for its bits
  (one row prefilled, copied to the others), the planner's predicted ms per step beside the measured.
- triton-torch, triton-fused: 1-bit specache at the paper's setting without the corrected set, through
  the torch code and through the fused Triton decode (SPECACHE_TRITON_DECODE=1), both eager.
  The other stages run the engine's default: decode passes replayed as CUDA graphs (`graph_replay` in
  each row: `replayed`, or the eager fallback and its error).
- not by default: paper-graphs, profile, quick, dynamic, variants, exact (scripts/gpu_stages.py).

Each stage runs as `scripts/gpu_stages.py STAGE` in its own process group under a timeout (the
smaller of its own and what is left of --budget-s): one that hangs is killed and recorded as
`timeout`, and the next runs. OUT/gpu_check.json is written after every stage: per stage its status,
seconds and result, and `results`, one row per timed run with context, batch, ms_per_step,
tokens_per_s, speedup_vs_full (against full at the same context), overlap and predicted_ms_per_step.
`--dry-run` runs the same runner with stand-in stages that write canned figures (no torch, no GPU):
the JSON, the budget and the summary in a few seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES_SCRIPT = ROOT / "scripts" / "gpu_stages.py"
DEFAULT_BUDGET_S = 510.0  # under 9 minutes: with the install, one device call (600 s at most) in a 15-minute lease
MIN_STAGE_S = 10.0  # a stage given less than this is skipped, not started
KILL_GRACE_S = 5.0  # after the timeout's SIGTERM, before SIGKILL
# each stage's own limit (seconds) and whether it runs by default; the defaults sum to DEFAULT_BUDGET_S or less
STAGES = {
    "versions": (20, True),
    "tests": (120, True),
    "graphs": (55, True),
    "paper-full": (50, True),
    "paper-1bit": (85, True),
    "paper-2bit": (75, True),
    "triton-torch": (50, True),
    "triton-fused": (50, True),
    "paper-graphs": (90, False),
    "profile": (60, False),
    "quick": (60, False),
    "dynamic": (45, False),
    "variants": (120, False),
    "exact": (90, False),
}
GROUPS = {"paper": ("paper-full", "paper-1bit", "paper-2bit"), "triton": ("triton-torch", "triton-fused")}
ROW_KEYS = ("context", "batch", "ms_per_step", "tokens_per_s", "speedup_vs_full", "overlap", "predicted_ms_per_step")


@dataclass(frozen=True)
class Stage:
    """A stage as the runner starts it: its name, its command line, its own time limit (seconds)."""

    name: str
    argv: list[str]
    timeout: float


def chosen(spec: str) -> list[str]:
    """The stage names of --stages (groups expanded, order kept, repeats dropped); an unknown name is an error."""
    names: list[str] = []
    for name in (x.strip() for x in spec.split(",") if x.strip()):
        for one in GROUPS.get(name, (name,)):
            if one not in STAGES:
                raise SystemExit(f"gpu_check: unknown stage {one!r}; stages: {', '.join([*STAGES, *GROUPS])}")
            if one not in names:
                names.append(one)
    return names


def default_stages() -> str:
    return ",".join(name for name, (_, default) in STAGES.items() if default)


def budget_lines(stages: list[Stage], budget_s: float) -> list[str]:
    """The budget as printed at the start: each stage's limit, their sum against the run's budget."""
    lines = [f"  {s.name:<14}{s.timeout:>6.0f} s" for s in stages]
    total = sum(s.timeout for s in stages)
    verdict = "fits" if total <= budget_s else "exceeds it: the last stages get what is left or are skipped"
    return [f"gpu_check budget {budget_s:.0f} s, {len(stages)} stages:", *lines,
            f"  {'sum':<14}{total:>6.0f} s ({verdict})"]


def kill_group(proc: subprocess.Popen) -> None:
    """End a stage's process group (the stage and what it started): SIGTERM, then SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(stage: Stage, limit: float, out: Path) -> dict:
    """Run one stage's process under `limit` seconds, its output in OUT/logs/NAME.log.
    -> its record: status (ok, failed, timeout), exit code, seconds, the log's path and last lines."""
    log = out / "logs" / f"{stage.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(stage.argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            kill_group(proc)
            code, status = proc.poll(), "timeout"
    tail = log.read_text(errors="replace").splitlines()[-8:]
    return {"status": status, "exit_code": code, "seconds": round(time.monotonic() - t, 1), "limit_s": round(limit, 1),
            "log": str(log.relative_to(out)), "log_tail": tail if status != "ok" else []}


def stage_result(out: Path, name: str):
    """What the stage wrote to OUT/stages/NAME.json (a killed stage may have left a partial one), or None."""
    path = out / "stages" / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def timed_runs(report: dict) -> list[dict]:
    """Every timed run in the stages' results (a dict with ms_per_step), tagged with its stage."""
    rows = []
    for name in report["stages"]:
        result = report.get("results_by_stage", {}).get(name)
        runs = result.get("runs", []) if isinstance(result, dict) else []
        if isinstance(result, dict) and not runs:  # graphs: {mode: {eager: run, graphs: run}}
            runs = [r | {"graphs": kind} for v in result.values() if isinstance(v, dict)
                    for kind, r in v.items() if isinstance(r, dict) and "ms_per_step" in r]
        rows += [{"stage": name} | r for r in runs if isinstance(r, dict) and "ms_per_step" in r]
    return rows


def results(report: dict) -> list[dict]:
    """One row per timed run (ROW_KEYS first), speedup_vs_full against the full cache's tokens/s at the
    same context (the first such run; graph replay against full replayed the same way where measured)."""
    rows = timed_runs(report)
    full = {}
    for r in rows:
        if r.get("mode") == "full":
            full.setdefault((r.get("context"), r.get("graphs")), r["tokens_per_s"])
            full.setdefault((r.get("context"), None), r["tokens_per_s"])
    out = []
    for r in rows:
        base = full.get((r.get("context"), r.get("graphs"))) or full.get((r.get("context"), None))
        speedup = round(r["tokens_per_s"] / base, 3) if base else None
        out.append({k: r.get(k) for k in ROW_KEYS} | {"speedup_vs_full": speedup} |
                   {k: r.get(k) for k in ("stage", "mode", "bits", "decode", "graphs", "graph_replay") if r.get(k) is not None})
    return out


def save(report: dict, out: Path) -> None:
    """Write the report so far, atomically (a run killed from outside keeps every stage it finished)."""
    report["results"] = results(report)
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out / "gpu_check.json")


def run_stages(stages: list[Stage], out: Path, budget_s: float, report: dict | None = None) -> dict:
    """Run the stages in order, each under min(its limit, what is left of budget_s) (none started with
    less than MIN_STAGE_S left: `skipped`), its result merged and the JSON saved after each."""
    out.mkdir(parents=True, exist_ok=True)
    report = (report or {}) | {"budget_s": budget_s, "stages": {}, "results_by_stage": {}}
    start = time.monotonic()
    save(report, out)
    for stage in stages:
        left = budget_s - (time.monotonic() - start)
        if left < MIN_STAGE_S:
            report["stages"][stage.name] = {"status": "skipped", "reason": f"{left:.0f} s of the budget left"}
        else:
            (out / "stages" / f"{stage.name}.json").unlink(missing_ok=True)
            report["stages"][stage.name] = run_one(stage, min(stage.timeout, left), out)
            report["results_by_stage"][stage.name] = stage_result(out, stage.name)
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        save(report, out)
        record = report["stages"][stage.name]
        print(f"[{stage.name}] {record['status']} in {record.get('seconds', 0)} s", file=sys.stderr, flush=True)
        for line in record.get("log_tail", []):
            print(f"    {line[:200]}", file=sys.stderr)
    return report


def summary(report: dict) -> list[str]:
    """A short table of the timed runs (printed last)."""
    lines = [f"{'stage':<14}{'mode':<10}{'bits':>5}{'ctx':>7}{'batch':>6}{'ms/step':>9}{'pred':>8}{'tok/s':>9}"
             f"{'x full':>8}{'overlap':>8}"]
    for r in report.get("results", []):
        def f(key, fmt):
            return "-" if r.get(key) is None else format(r[key], fmt)
        lines.append(f"{r['stage'] + ('+g' if r.get('graphs') == 'graphs' else ''):<14}{r.get('mode', ''):<10}"
                     f"{f('bits', 'd'):>5}{f('context', 'd'):>7}{f('batch', 'd'):>6}{f('ms_per_step', '.1f'):>9}"
                     f"{f('predicted_ms_per_step', '.1f'):>8}{f('tokens_per_s', '.1f'):>9}"
                     f"{f('speedup_vs_full', '.2f'):>8}{f('overlap', '.3f'):>8}")
    states = ", ".join(f"{n} {s['status']}" for n, s in report.get("stages", {}).items())
    return lines + [f"stages: {states}"]


def stage_argv(name: str, args) -> list[str]:
    """The command line of one stage's process (a stand-in with --dry-run)."""
    if args.dry_run:
        return [sys.executable, str(Path(__file__).resolve()), "--fake-stage", name, "--out", str(args.out)]
    limit = STAGES[name][0]
    return [sys.executable, str(STAGES_SCRIPT), name, "--out", str(args.out), "--context", str(args.context),
            "--budget-gb", str(args.budget_gb), "--steps", str(args.steps), "--chunk", str(args.chunk),
            "--tests-timeout", str(max(limit - 15, 10))]


def fake_stage(name: str, out: Path) -> int:
    """--dry-run's stand-in for a stage: canned figures of the shape the real stage writes (no torch)."""
    ms = {"paper-full": (6, 40.0, None, 42.0), "paper-1bit": (22, 30.0, 1.0, 25.0),
          "paper-2bit": (16, 28.0, 0.99, 24.0), "triton-torch": (22, 45.0, 1.0, 25.0),
          "triton-fused": (22, 26.0, 1.0, 25.0)}
    result: dict = {"dry_run": True}
    if name in ms:
        batch, step, overlap, pred = ms[name]
        mode = "full" if name == "paper-full" else "specache"
        result["runs"] = [{"mode": mode, "context": 32768, "batch": batch, "ms_per_step": step,
                           "tokens_per_s": round(batch * 1000 / step, 2), "overlap": overlap,
                           "predicted_ms_per_step": pred, "bits": None if mode == "full" else int("2bit" in name) + 1}]
    (out / "stages").mkdir(parents=True, exist_ok=True)
    (out / "stages" / f"{name}.json").write_text(json.dumps(result))
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"), help="folder of gpu_check.json and logs")
    ap.add_argument("--stages", default=default_stages(), help=f"comma-separated, of {', '.join([*STAGES, *GROUPS])}")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's seconds")
    ap.add_argument("--context", type=int, default=32768, help="the paper stages' context")
    ap.add_argument("--budget-gb", type=float, default=48.0, help="the device budget the planner plans for")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per run")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    ap.add_argument("--dry-run", action="store_true", help="stand-in stages: the runner and the JSON, no GPU")
    ap.add_argument("--fake-stage", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.fake_stage:
        return fake_stage(args.fake_stage, out)
    stages = [Stage(name, stage_argv(name, args), STAGES[name][0]) for name in chosen(args.stages)]
    print("\n".join(budget_lines(stages, args.budget_s)), file=sys.stderr, flush=True)
    report = run_stages(stages, out, args.budget_s, {"dry_run": args.dry_run, "context": args.context,
                                                     "budget_gb": args.budget_gb, "steps": args.steps})
    print("\n".join(summary(report)))
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
