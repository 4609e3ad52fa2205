"""The Typer application: a thin layer that parses flags, calls the engine and renders results.

Results go to stdout (text, --json or --jsonl); progress, timings and logs go to stderr.
Every user error is a typed engine.errors.SpecacheError mapped to a one-line message and
its own exit code here; nothing else in the project calls sys.exit.
"""
from __future__ import annotations

import sys

import typer

from engine.errors import SpecacheError
from specache_cli.console import err_console

app = typer.Typer(
    name="specache",
    help="Summarize and question long documents with a local LLM (SpeCache KV caching).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each command module exposes register(app). Keep this list the only place commands are wired.
from specache_cli import run_cmds  # noqa: E402

for _module in (run_cmds,):
    _module.register(app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning user errors into exit codes."""
    try:
        app(args=argv, standalone_mode=False)
    except SpecacheError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        sys.exit(130)
    except typer.Exit as exc:  # raised by commands for plain exits
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("[bold red]aborted[/]")
        sys.exit(130)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.ClickException):
            exc.show(file=sys.stderr)
            sys.exit(exc.exit_code)
        raise
