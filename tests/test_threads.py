"""CPU threads for a run (engine/plan/threads.py, --threads): the free cores of a short /proc/stat
sample unless --threads or $OMP_NUM_THREADS says; 2 threads on a 2-core machine with one core
busy elsewhere ran 3x slower than 1 (docs/results.md, "CPU threads")."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.plan import threads as T


@pytest.mark.parametrize("cores,busy,want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.0, 1),
                                             (8, 3.2, 5), (8, 0.1, 8), (1, 0.9, 1)])
def test_threads_are_the_free_cores(cores, busy, want):
    assert T.threads_for(cores, busy) == want


STAT = """cpu  300 0 100 600 0 0 0 0 0 0
cpu0 100 0 50 300 0 0 0 0 0 0
cpu1 200 0 50 300 0 0 0 0 0 0
intr 12345
"""


def test_busy_cores_from_two_samples(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text(STAT)
    # cpu0: 90 of 100 jiffies busy; cpu1: 10 of 100 busy (idle + iowait count as free)
    b.write_text(STAT.replace("cpu0 100 0 50 300 0", "cpu0 190 0 50 305 5").replace(
        "cpu1 200 0 50 300 0", "cpu1 210 0 50 360 30"))
    before, after = T.read_cpu_times(str(a)), T.read_cpu_times(str(b))
    assert before == {0: (150, 450), 1: (250, 550)}
    assert T.busy_cores(before, after, [0, 1]) == pytest.approx(1.0)
    assert T.busy_cores(before, after, [1]) == pytest.approx(0.1)  # only the CPUs this process may use
    assert T.busy_cores(before, after, [5]) is None
    assert T.read_cpu_times(str(tmp_path / "missing")) == {}


def test_choice_order(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert T.choose_threads(2) == T.ThreadChoice(2, len(T.allowed_cpus()), None, "--threads")
    assert T.choose_threads(None).threads == 3 and T.choose_threads(None).reason == "OMP_NUM_THREADS"
    monkeypatch.delenv("OMP_NUM_THREADS")
    samples = iter([{0: (0, 100), 1: (0, 100)}, {0: (95, 200), 1: (5, 200)}])  # one core kept busy
    monkeypatch.setattr(T, "read_cpu_times", lambda: next(samples))
    monkeypatch.setattr(T, "allowed_cpus", lambda: [0, 1])
    assert T.choose_threads(None, sample_seconds=0) == T.ThreadChoice(1, 2, 1.0, "free cores")
    monkeypatch.setattr(T, "read_cpu_times", lambda: {})  # no /proc/stat: every allowed core
    assert T.choose_threads(None, sample_seconds=0) == T.ThreadChoice(2, 2, None, "all cores")


def test_cli_threads_flag(tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from specache_cli.app import app

    doc = str(Path(__file__).parent / "data" / "sample.txt")
    base = ["ask", "--model", str(tiny_model_dir), "--no-store", "--doc", doc, "What is it?", "--max-tokens", "3",
            "--group", "32", "--json"]
    before = torch.get_num_threads()
    runner = CliRunner()
    try:
        one = runner.invoke(app, [*base, "--threads", "1"])
        assert one.exit_code == 0, one.stderr
        assert json.loads(one.stdout)["threads"] == 1 and torch.get_num_threads() == 1
        assert runner.invoke(app, [*base, "--threads", "0"]).exit_code == 2
        both = runner.invoke(app, [*base, "--threads", "1", "--workers", "2"])
        assert both.exit_code == 2 and "--threads-per-worker" in both.stderr
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # one core kept busy: a note, 1 thread
        monkeypatch.setattr(T, "allowed_cpus", lambda: [0, 1])
        samples = iter([{0: (0, 100), 1: (0, 100)}, {0: (95, 200), 1: (5, 200)}])
        monkeypatch.setattr(T, "read_cpu_times", lambda: next(samples))
        busy = runner.invoke(app, [*base[:-1]])
        assert busy.exit_code == 0 and "the machine is busy (1.0 of 2 cores" in busy.stderr, busy.stderr
    finally:
        torch.set_num_threads(before)
