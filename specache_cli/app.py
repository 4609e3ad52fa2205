"""The Typer application: a thin layer that parses flags, calls the engine and renders results.

Results go to stdout (text, --json or --jsonl); progress, timings and logs go to stderr.
Every user error is a typed engine.errors.SpecacheError, mapped to a one-line message and its
own exit code by console.guarded around each command.
"""
from __future__ import annotations

import os
import re
import sys

import typer
import typer.main

from engine.errors import INTERRUPTED_EXIT

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
from specache_cli import bench_cmd, cache_cmd, models_cmd, plan_cmd, run_cmds  # noqa: E402
from specache_cli.console import print_error  # noqa: E402

for _module in (run_cmds, plan_cmd, bench_cmd, cache_cmd, models_cmd):
    _module.register(app)


FLAG = re.compile(r"--?[A-Za-z][\w-]*")  # what looks like a flag (not "-", not a negative number)


def usage_message(exc: Exception, argv: list[str] | None = None) -> str:
    """Click's usage error as one line, with a hint for a file name that starts with a dash; an
    unknown flag comes with every other unknown flag of the command line (Click stops at the first)."""
    message = " ".join(exc.format_message().split()) if hasattr(exc, "format_message") else str(exc)
    message = message.rstrip(".")
    option = getattr(exc, "option_name", None)
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoSuchOption" and option:
        if not option.startswith("--"):
            message += " (to name a file that starts with '-', put '--' before it or write it as ./-name)"
        if ctx is not None:
            others = [f for f in unknown_flags(ctx.command, argv if argv is not None else sys.argv[1:]) if f != option]
            if others:
                message += f"; also unknown: {', '.join(others)}"
    if ctx is not None and ctx.command_path:
        message += f"; see {ctx.command_path} --help"
    return message


def unknown_flags(command, argv: list[str]) -> list[str]:
    """The flags of argv (before a "--") that `command` does not have, once each, in order."""
    known = {"--help"} | {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    out: list[str] = []
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if FLAG.fullmatch(name) and name not in known and name not in out:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. Commands are wrapped by console.guarded, so user errors arrive
    here as an exit code, their one-line message printed; Click's own usage errors (unknown flag,
    a value that is not a number, a missing argument) are printed here the same way, exit 2."""
    try:
        code = run(argv)
    except BrokenPipeError:  # the reader went away (`| head`): not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the final flush is quiet
        except (OSError, ValueError):
            pass
        code = 141  # 128 + SIGPIPE, as a shell reports a pipe writer it killed
    sys.exit(code)


def run(argv: list[str] | None = None) -> int:
    """Run the command line; -> its exit code."""
    command = typer.main.get_command(app)
    try:
        code = command.main(argv, prog_name="specache", standalone_mode=False)
    except (typer.Abort, KeyboardInterrupt):  # Ctrl-C outside a command, or Click's own abort
        print_error("interrupted")
        return INTERRUPTED_EXIT
    except typer.exceptions.TyperException as exc:  # Click's ClickException family: usage errors
        if type(exc).__name__ != "NoArgsIsHelpError":  # (that one: Typer has printed the help already)
            print_error(usage_message(exc, argv))
        return int(getattr(exc, "exit_code", 2))
    return code if isinstance(code, int) else 0
