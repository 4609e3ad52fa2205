"""The stderr console every command renders progress and logs on (stdout stays for results),
and the guard that turns every failure into a one-line `error:` message and its exit code."""
from __future__ import annotations

import errno
import functools
import os

import typer
from rich.console import Console
from rich.text import Text

from engine.errors import INTERRUPTED_EXIT, DoesNotFit, SpecacheError, StorageError

err_console = Console(stderr=True, soft_wrap=True)  # log lines are never cut at 80 columns

DEBUG_ENV = "SPECACHE_DEBUG"  # set to 1 to get the Python traceback of an unexpected error
_OOM_SIGNS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def print_error(message: str) -> None:
    """One `error: ...` line on stderr (never wrapped, so a log keeps it on one line)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", " ".join(str(message).split())),
                      highlight=False, soft_wrap=True)


def print_warning(message: str) -> None:
    """One `warning: ...` line on stderr."""
    err_console.print(Text.assemble(("warning:", "yellow"), " ", " ".join(str(message).split())),
                      highlight=False, soft_wrap=True)


def os_error_message(exc: OSError) -> str:
    """'<what went wrong>: <file>' for an OSError that reached the command (a disk full, a read-only
    folder, a cache folder below a regular file...)."""
    what = exc.strerror or type(exc).__name__
    where = f": {exc.filename}" if exc.filename else ""
    hint = ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = " (free some space, or point SPECACHE_CACHE_DIR at a disk that has some)"
    elif exc.errno in (errno.ENOTDIR, errno.EROFS, errno.EACCES, errno.EPERM):
        hint = " (check SPECACHE_CACHE_DIR and the permissions of the folders on the way)"
    return f"cannot write or read a file: {what}{where}{hint}"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CPU and CUDA allocators and Python itself, each in its own words."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _OOM_SIGNS)


def as_user_error(exc: BaseException) -> SpecacheError | None:
    """The typed error an unexpected exception stands for (disk, memory), or None."""
    if is_out_of_memory(exc):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return DoesNotFit(f"out of memory while running ({first}); lower --batch, --k, --chunk-size or "
                          "--max-tokens, or use a smaller --cache mode")
    if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
        return StorageError(os_error_message(exc))
    return None


def guarded(fn):
    """Wrap a command: a SpecacheError becomes `error: <message>` on stderr and its exit code; an
    OSError (disk full, not a folder...) exit 14, running out of memory exit 12, Ctrl-C exit 130,
    anything else one `error: internal error` line and exit 1 (SPECACHE_DEBUG=1 shows the traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecacheError as exc:
            print_error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, BrokenPipeError):
            raise
        except KeyboardInterrupt:
            print_error("interrupted")
            raise typer.Exit(INTERRUPTED_EXIT) from None
        except Exception as exc:  # the last line of defence: one line, never a traceback
            if os.environ.get(DEBUG_ENV):
                raise
            user = as_user_error(exc)
            if user is None:
                detail = " ".join(str(exc).split())[:300]
                print_error(f"internal error ({type(exc).__name__}{': ' + detail if detail else ''}); "
                            f"rerun with {DEBUG_ENV}=1 for the traceback and please report it")
                raise typer.Exit(1) from None
            print_error(str(user))
            raise typer.Exit(user.exit_code) from None

    return wrapper
