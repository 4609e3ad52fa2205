"""Render engine events: progress on stderr (rich), text and JSON on stdout.

Two kinds of stderr:
- a terminal: a transient rich progress display that is stopped (and cleared) before any answer
  text is written to stdout, so the text streams as text, word after word, and never goes through
  rich's stdout redirection (which printed one token per line);
- anything else (a log file, a pipe, a batch job): plain lines, one per finished stage (a PDF read,
  a prefill, a map-reduce section) with its counts and elapsed time, and a line every LOG_EVERY
  seconds for a stage still running. No control characters.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from engine.jobs.pipeline import Failed, Result, Stage, Status, TextDelta
from specache_cli.console import err_console

LOG_EVERY = 30.0  # seconds between two plain lines of one stage still running


@dataclass
class _LogTask:
    description: str
    total: float | None
    unit: str
    started: float
    completed: float = 0.0
    last_line: float = 0.0
    done: bool = False


@dataclass
class LogProgress:
    """Progress as plain stderr lines (stderr is not a terminal): the subset of rich's Progress API the
    CLI uses (add_task, update, remove_task, stop). `clock` is time.monotonic (tests pass their own)."""

    console: Console
    clock: object = time.monotonic
    tasks: dict[int, _LogTask] = field(default_factory=dict)

    def add_task(self, description: str, total: float | None = None, unit: str = "", **_) -> int:
        task = len(self.tasks) + 1
        now = self.clock()
        self.tasks[task] = _LogTask(description, total, unit, now, last_line=now)
        return task

    def update(self, task: int, completed: float | None = None, total: float | None = None, **_) -> None:
        t = self.tasks.get(task)
        if t is None or t.done:
            return
        if total is not None:
            t.total = total
        if completed is not None:
            t.completed = completed
        now = self.clock()
        finished = t.total is not None and t.completed >= t.total
        if finished or now - t.last_line >= LOG_EVERY:
            t.done, t.last_line = finished, now
            self.console.print(self.line(t, now), markup=False, highlight=False, soft_wrap=True)

    @staticmethod
    def line(t: _LogTask, now: float) -> str:
        """'section 2/9: 1834/1834 tokens in 4.2 s' (or '... so far' for a running stage)."""
        count = f"{t.completed:.0f}/{t.total:.0f}" if t.total is not None else f"{t.completed:.0f}"
        unit = f" {t.unit}" if t.unit else ""
        tail = "" if t.done else " so far"
        return f"{t.description}: {count}{unit} in {now - t.started:.1f} s{tail}"

    def remove_task(self, task: int) -> None:
        self.tasks.pop(task, None)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def make_progress(quiet: bool, console: Console = err_console) -> Progress | LogProgress:
    """A rich progress display for a terminal, plain lines otherwise (disabled when quiet)."""
    if console.is_terminal or quiet:
        # redirect_stdout=False: stdout text must never be captured and re-printed by rich line by line
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=quiet, redirect_stdout=False,
                        redirect_stderr=False)
    return LogProgress(console)


@contextmanager
def progress_bar(quiet: bool) -> Iterator[Progress | LogProgress]:
    """A stderr progress display: rich in a terminal, plain lines in a log, nothing when quiet."""
    bar = make_progress(quiet)
    bar.start()
    try:
        yield bar
    finally:
        bar.stop()


class StageView:
    """The prefill stages of jobs on a progress display; `pause` clears it from the screen before text is
    written to stdout (a later stage shows it again)."""

    def __init__(self, bar: Progress | LogProgress):
        self.bar = bar
        self.tasks: dict[str, TaskID | int] = {}
        self.live = True

    def stage(self, event: Stage) -> None:
        if not self.live:
            self.bar.start()
            self.live = True
        if event.label not in self.tasks:
            self.tasks[event.label] = self.bar.add_task(event.label, total=event.total, unit="tokens")
        self.bar.update(self.tasks[event.label], completed=event.done, total=event.total)

    def clear(self) -> None:
        for task in self.tasks.values():
            self.bar.remove_task(task)
        self.tasks.clear()

    def pause(self) -> None:
        """Take the display off the screen (a terminal's live display is stopped and erased)."""
        self.clear()
        if self.live:
            self.bar.stop()
            self.live = False


def render_jobs(events, quiet: bool, stream_text: bool) -> Iterator[Result | Failed]:
    """Drive a pipeline generator: progress to stderr, streamed text to stdout; yield each Result
    (and each Failed document of a multi-document run)."""
    with progress_bar(quiet) as bar:
        view = StageView(bar)
        streaming = False
        for event in events:
            if isinstance(event, Stage):
                view.stage(event)
            elif isinstance(event, Status):
                if not quiet:
                    err_console.print(event.message, highlight=False, markup=False, soft_wrap=True)
            elif isinstance(event, TextDelta):
                if stream_text:
                    if not streaming:
                        view.pause()
                        err_console.file.flush()
                        streaming = True
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, Failed):
                view.clear()
                yield event
            elif isinstance(event, Result):
                if stream_text and streaming:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                streaming = False
                view.clear()
                yield event


def print_timings(result: Result) -> None:
    """One stderr line of timings and cache sizes."""
    c = result.cache
    ms = 1000 * result.decode_seconds / result.generated_tokens if result.generated_tokens else 0.0
    if result.store and result.store.get("hit"):  # the document came from the store: no prefill rate to show
        prefill = f"prompt {result.prompt_tokens} tokens (document loaded from the store) in {result.prefill_seconds:.1f} s"
    else:
        pre = result.prompt_tokens / result.prefill_seconds if result.prefill_seconds else 0.0
        prefill = f"prefill {result.prompt_tokens} tokens in {result.prefill_seconds:.1f} s ({pre:.0f} tok/s)"
    line = (f"[dim]{result.strategy}: {prefill} · decode {result.generated_tokens} tokens in {result.decode_seconds:.1f} s "
            f"({ms:.1f} ms/token, {result.finish_reason})")
    if c:
        line += (f" · cache {c.get('mode')}: device {c.get('device_bytes', 0) / 2**20:.1f} MiB, "
                 f"host {c.get('host_bytes', 0) / 2**20:.1f} MiB{_mapped(c)}, "
                 f"fp16 full {c.get('full_fp16_bytes', 0) / 2**20:.1f} MiB")
        guide = guide_settings(c)
        if guide:
            line += f" · guide {guide}"
        if c.get("acceptance_rate") is not None:  # exact mode: how well the drafts did
            line += (f", drafts accepted {100 * c['acceptance_rate']:.0f}%, {c['tokens_per_verify']:.1f} tokens "
                     f"per verification")
        if c.get("backend"):
            line += f" · kernels {c['backend']['name']}"
        if c.get("fused_decode"):  # a policy's own hook: its layers decode by the torch reference
            line += f" (fused decode: {c['fused_decode']})"
    err_console.print(line + "[/]", highlight=False, soft_wrap=True)


def _mapped(c: dict) -> str:
    """What of the host store a stored document's entry backs (mapped, not read in), "" where none does."""
    if not c.get("host_mapped_bytes"):
        return ""
    return (f" ({c['host_mapped_bytes'] / 2**20:.1f} MiB mapped from the store, "
            f"{c.get('host_mapped_resident_bytes', 0) / 2**20:.1f} MiB of it in memory)")


def guide_settings(c: dict) -> str:
    """What the guide ran with (the model's defaults, a profile's or the flags') and how its watch found it:
    "2-bit, k 128, 2 outlier channels, Hadamard on 28 of 28 layers, check 0.94"; "" without a guide."""
    if c.get("bits") is None or c.get("guided_layers") is None:
        return ""
    parts = [f"{c['bits']}-bit", f"k {c.get('k')}"]
    if c.get("outliers"):
        parts.append(f"{c['outliers']} outlier channels")
    if c.get("rotation") not in (None, "none"):
        parts.append(f"rotation {c['rotation']} ({c.get('rotated_layers', 0)} of {c['guided_layers']} layers rotated)")
    check = c.get("guide_check") or {}
    if check.get("checks"):
        parts.append(f"check {check['coverage_vs_oracle']:.2f}" + (" (lost: exact from here)" if check["lost"] else ""))
    return ", ".join(parts)


def emit_json(obj: dict, lines: bool) -> None:
    """--json: an indented object; --jsonl: one compact line."""
    text = json.dumps(obj, ensure_ascii=False) if lines else json.dumps(obj, ensure_ascii=False, indent=2)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
