"""The Typer application: a thin layer that parses flags, calls the engine and renders results.

Results go to stdout (text, --json or --jsonl); progress, timings and logs go to stderr.
Every user error is a typed engine.errors.SpecacheError, mapped to a one-line message and its
own exit code by console.guarded around each command.
"""
from __future__ import annotations

import typer

app = typer.Typer(
    name="specache",
    help="Summarize and question long documents with a local LLM (SpeCache KV caching).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("specache")
        except PackageNotFoundError:  # running from a checkout that is not installed
            v = "unknown (not installed)"
        typer.echo(f"specache {v}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Summarize and question long documents with a local LLM (SpeCache KV caching)."""


# Each command module exposes register(app). Keep this list the only place commands are wired.
from specache_cli import bench_cmd, cache_cmd, plan_cmd, run_cmds  # noqa: E402

for _module in (run_cmds, plan_cmd, bench_cmd, cache_cmd):
    _module.register(app)


def main() -> None:
    """Console-script entry point. Commands are wrapped by console.guarded, so user errors
    already arrive here as a one-line message and their exit code; click maps bad flags to 2."""
    app()
