"""Render engine events: progress on stderr (rich), text and JSON on stdout."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from engine.jobs.pipeline import Failed, Result, Stage, Status, TextDelta
from specache_cli.console import err_console


@contextmanager
def progress_bar(quiet: bool) -> Iterator[Progress]:
    """A stderr progress display (disabled when quiet or stderr is not a terminal)."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err_console, transient=True, disable=quiet)
    with bar:
        yield bar


def render_jobs(events, quiet: bool, stream_text: bool) -> Iterator[Result | Failed]:
    """Drive a pipeline generator: progress to stderr, streamed text to stdout; yield each Result
    (and each Failed document of a multi-document run)."""
    tasks: dict[str, int] = {}
    with progress_bar(quiet) as bar:
        for event in events:
            if isinstance(event, Stage):
                if event.label not in tasks:
                    tasks[event.label] = bar.add_task(event.label, total=event.total)
                bar.update(tasks[event.label], completed=event.done)
            elif isinstance(event, Status):
                if not quiet:
                    err_console.print(event.message, highlight=False)
            elif isinstance(event, TextDelta):
                if stream_text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, Failed):
                for task in tasks.values():
                    bar.remove_task(task)
                tasks.clear()
                yield event
            elif isinstance(event, Result):
                if stream_text:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                for task in tasks.values():
                    bar.remove_task(task)
                tasks.clear()
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
            f"({ms:.1f} ms/token)")
    if c:
        line += (f" · cache {c.get('mode')}: device {c.get('device_bytes', 0) / 2**20:.1f} MiB, "
                 f"host {c.get('host_bytes', 0) / 2**20:.1f} MiB, fp16 full {c.get('full_fp16_bytes', 0) / 2**20:.1f} MiB")
    err_console.print(line + "[/]", highlight=False)


def emit_json(obj: dict, lines: bool) -> None:
    """--json: an indented object; --jsonl: one compact line."""
    text = json.dumps(obj, ensure_ascii=False) if lines else json.dumps(obj, ensure_ascii=False, indent=2)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
