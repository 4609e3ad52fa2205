"""`--workers N`: run a summarize / ask job on Ray actors (engine.jobs.workers) and show it on
stderr: documents done / total, tokens per second over the job and one line per worker.
Results are written by the caller's `write` as they complete, never cut by Ctrl-C."""
from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from engine.errors import SpecacheError
from engine.jobs.pipeline import Failed, Result
from engine.jobs.workers import Retry, Tick, WorkerState
from specache_cli.console import err_console


class Interrupted(SpecacheError):
    """Ctrl-C during a job with workers: the workers are stopped, the lines written are whole."""

    exit_code = 130
    code = "interrupted"


@dataclass
class JobSummary:
    done: int = 0
    failed: int = 0
    tokens: int = 0  # prompt + generated tokens of the results
    seconds: float = 0.0  # from the first worker ready to the last result
    startup_seconds: float = 0.0  # starting (or joining) Ray and the first worker's model load


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold Ctrl-C while a result line is written; raise it (KeyboardInterrupt) once the line is whole."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def worker_line(s: WorkerState, now: float) -> str:
    where = f"pid {s.pid}" if s.pid else "no process"
    if s.device:
        where += f", {s.device}"
        if s.threads and s.device == "cpu":
            where += f", {s.threads} thread{'s' * (s.threads != 1)}"
    what = {"working": f"working on {s.task}", "starting": "loading the model", "restarting": "restarting",
            "gone": "gone (died too often)"}.get(s.state, s.state)
    return f"  worker {s.index + 1} ({where}): {what} for {now - s.since:.0f} s · {s.done} done"


def render_job(events, total: int, workers: int, quiet: bool, write: Callable[[Result | Failed, TextIO], None],
               noun: str = "documents") -> JobSummary:
    """Drive run_job's events: results to `write(item, stdout)` (Ctrl-C deferred while it runs),
    progress on stderr. A KeyboardInterrupt closes the job (its workers are killed) and becomes
    Interrupted.

    Ray's driver prints raylet messages ("A worker died ...") on sys.stdout from a thread of its
    own; stdout carries results only, so for the job sys.stdout is stderr and `write` is handed
    the real stdout."""
    stdout = sys.stdout
    with redirect_stdout(sys.stderr):
        return _render(events, total, workers, quiet, lambda item: write(item, stdout), noun)


def _render(events, total: int, workers: int, quiet: bool, write: Callable[[Result | Failed], None],
            noun: str) -> JobSummary:
    summary = JobSummary()
    start = time.monotonic()
    states: dict[int, WorkerState] = {}
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err_console)
    task = bar.add_task(noun, total=total)
    lines = Text("")
    view = Group(bar, lines)

    def refresh() -> None:
        elapsed = time.monotonic() - start - summary.startup_seconds if summary.startup_seconds else 0.0
        rate = summary.tokens / elapsed if elapsed > 0 else 0.0  # over the job, since the first worker was ready
        bar.update(task, completed=summary.done + summary.failed,
                   description=f"{noun} on {workers} worker{'s' * (workers != 1)} · {rate:.0f} tok/s")
        now = time.monotonic()
        lines.plain = "\n".join(worker_line(states[i], now) for i in sorted(states))

    shown = not quiet and err_console.is_terminal  # a log file gets the lines printed below, not a live view
    try:
        with (Live(view, console=err_console, transient=True, refresh_per_second=4,
                                redirect_stdout=False, redirect_stderr=False) if shown else _nothing()):
            for event in events:
                if isinstance(event, WorkerState):
                    before = states.get(event.index)
                    states[event.index] = event
                    if event.state == "ready" and not summary.startup_seconds:
                        summary.startup_seconds = time.monotonic() - start
                    if not quiet and event.state == "ready" and (before is None or before.state != "ready"):
                        err_console.print(f"[dim]worker {event.index + 1} ready: pid {event.pid} on {event.node} "
                                          f"({event.device}, {event.threads} thread{'s' * (event.threads != 1)})[/]", highlight=False)
                elif isinstance(event, Retry):
                    err_console.print(f"[yellow]warning:[/] worker {event.worker + 1} died ({event.reason}) while "
                                      f"working on {escape(event.task)}; Ray restarts it and its {event.units} "
                                      f"{noun if event.units != 1 else noun.rstrip('s')} are retried",
                                      highlight=False, soft_wrap=True)
                elif isinstance(event, (Result, Failed)):
                    with deferred_sigint():
                        write(event)
                    if isinstance(event, Result):
                        summary.done += 1
                        summary.tokens += event.prompt_tokens + event.generated_tokens
                    else:
                        summary.failed += 1
                elif not isinstance(event, Tick):
                    continue
                refresh()
    except KeyboardInterrupt:
        events.close()  # kills the workers (and shuts down a runtime the job started)
        raise Interrupted(f"interrupted: {summary.done + summary.failed} of {total} {noun} written; "
                          "the workers are stopped (--resume OUT.jsonl goes on from here)") from None
    summary.seconds = max(time.monotonic() - start - summary.startup_seconds, 1e-9)
    if not quiet:
        per_min = 60 * (summary.done + summary.failed) / summary.seconds
        err_console.print(f"[dim]{summary.done + summary.failed} {noun} ({summary.failed} failed) in "
                          f"{summary.seconds:.1f} s on {workers} worker{'s' * (workers != 1)} after "
                          f"{summary.startup_seconds:.1f} s of start-up: {per_min:.1f} {noun}/min, "
                          f"{summary.tokens / summary.seconds:.0f} tok/s (prompt + generated)[/]", highlight=False)
    return summary


@contextmanager
def _nothing() -> Iterator[None]:
    yield
