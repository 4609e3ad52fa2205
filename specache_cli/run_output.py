"""How summarize and ask write their answers (specache_cli/run_cmds.py): each finished result on stdout (JSON,
JSON lines or text) with its timings on stderr; a job with workers one document or question at a time."""
from __future__ import annotations

import json
import sys
from typing import TextIO

from rich.markup import escape

from engine.jobs.pipeline import Failed, Result
from specache_cli.console import err_console
from specache_cli.options import OutputOptions
from specache_cli.render import emit_json, print_timings


def output(results, structured: bool, jsonl: bool, quiet: bool, header: bool) -> None:
    """Print each finished result: JSON on stdout, timings on stderr (text was streamed or is printed)."""
    for result in results:
        if structured:
            emit_json(result.to_json(), jsonl)
        elif header:
            label = f"Q: {result.question}" if result.question else f"# {result.source}"
            sys.stdout.write(f"{label}\n{result.text}\n\n")
        if not quiet:
            print_timings(result)


def write_item(item: Result | Failed, stdout: TextIO, out: OutputOptions) -> None:
    """One finished document (or question) of a job with workers, on `stdout`: as output() and the
    error lines of summarize_cmd write them (a Failed's question, for ask, is in its error line)."""
    if isinstance(item, Failed):
        err_console.print(f"[bold red]error:[/] {escape(str(item.error))}", highlight=False, soft_wrap=True)
        question = getattr(item, "question", None)
        obj = {"source": item.source, **({"question": question} if question is not None else {}),
               "error": {"code": item.error.code, "exit_code": item.error.exit_code, "message": str(item.error)}}
    else:
        obj = item.to_json()
    if out.structured:
        stdout.write((json.dumps(obj, ensure_ascii=False) if out.jsonl else
                      json.dumps(obj, ensure_ascii=False, indent=2)) + "\n")
    elif isinstance(item, Result):
        label = f"Q: {item.question}" if item.question else f"# {item.source}"
        stdout.write(f"{label}\n{item.text}\n\n")
    stdout.flush()
    if isinstance(item, Result) and not out.quiet:
        print_timings(item)
