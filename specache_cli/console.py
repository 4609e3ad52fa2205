"""The stderr console every command renders progress and logs on (stdout stays for results),
and the guard that turns typed user errors into a one-line message and their exit code."""
from __future__ import annotations

import functools

import typer
from rich.console import Console

from engine.errors import SpecacheError

err_console = Console(stderr=True, soft_wrap=True)  # log lines are never cut at 80 columns


def guarded(fn):
    """Wrap a command: a SpecacheError becomes `error: <message>` on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecacheError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper
