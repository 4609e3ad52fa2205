"""CPU threads for a run: the cores this process may use, fewer when other work keeps some busy.

Measured on this project's 2-core machine (scripts/threads_ab.sh: summarize examples/report.pdf,
64 tokens, means of 2 rounds): quiet, 2 threads prefill 5.5 s / decode 16.4 ms per token, 1 thread
8.6 s / 20.0 ms; with one core kept busy by another process, 2 threads 14.1 s / 47.9 ms (OpenMP
threads wait on each other at every parallel region while one of them is descheduled), 1 thread
8.7 s / 20.7 ms. So the default counts the cores that are free when the
run starts: the busy share of each allowed CPU over a short sample of /proc/stat (instantaneous,
unlike the load average, which a previous run of a shell loop keeps high for a minute).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

SAMPLE_SECONDS = 0.1  # how long the CPUs are watched before a run


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cores: int  # CPUs this process may run on
    busy: float | None  # cores kept busy by other work during the sample (None: not measured)
    reason: str  # "--threads", "OMP_NUM_THREADS", "free cores", "all cores"


def threads_for(cores: int, busy: float) -> int:
    """Threads for `cores` allowed CPUs of which `busy` (in cores) are used by others: the free cores,
    rounded (a core more than half free counts), at least 1."""
    return max(1, min(cores, int(cores - busy + 0.5)))


def allowed_cpus() -> list[int]:
    """The CPU numbers this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """Per CPU (busy, total) jiffies from /proc/stat; {} where there is none (not Linux)."""
    out = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or len(fields) < 4:
                    continue
                values = [int(v) for v in fields[:8]]
                idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
                out[int(name[3:])] = (sum(values) - idle, sum(values))
    except (OSError, ValueError):
        return {}
    return out


def busy_cores(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpus: list[int]) -> float | None:
    """Cores' worth of busy time on `cpus` between two read_cpu_times samples (None: no data)."""
    total = 0.0
    seen = False
    for cpu in cpus:
        if cpu in before and cpu in after:
            busy, elapsed = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
            if elapsed > 0:
                total += busy / elapsed
                seen = True
    return total if seen else None


def choose_threads(requested: int | None, sample_seconds: float = SAMPLE_SECONDS) -> ThreadChoice:
    """--threads N when given, else $OMP_NUM_THREADS when set, else the free cores of a short sample."""
    cpus = allowed_cpus()
    if requested is not None:
        return ThreadChoice(requested, len(cpus), None, "--threads")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), len(cpus), None, "OMP_NUM_THREADS")
    before = read_cpu_times()
    if not before or len(cpus) == 1:
        return ThreadChoice(len(cpus), len(cpus), None, "all cores")
    time.sleep(sample_seconds)
    busy = busy_cores(before, read_cpu_times(), cpus)
    if busy is None:
        return ThreadChoice(len(cpus), len(cpus), None, "all cores")
    return ThreadChoice(threads_for(len(cpus), busy), len(cpus), round(busy, 2), "free cores")
