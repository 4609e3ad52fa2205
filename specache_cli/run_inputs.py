"""What summarize and ask read besides the model (specache_cli/run_cmds.py): the documents, --questions FILE,
and the --jsonl output of an earlier run that --resume skips the finished work of."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from engine.errors import BadArgument, InputNotFound
from engine.inputs.documents import decode_text, load_document, read_regular_file
from specache_cli.options import OutputOptions
from specache_cli.render import progress_bar


def read_document(source: str, password: Optional[str], quiet: bool):
    """Read one document, with a page progress bar for PDFs."""
    with progress_bar(quiet) as bar:
        task = bar.add_task(f"reading {Path(source).name}", total=None, unit="pages")
        return load_document(source, password=password, stdin=sys.stdin,
                             on_page=lambda i, n: bar.update(task, completed=i + 1, total=n))


RESUME = typer.Option(None, "--resume", help="The --jsonl output of an earlier run: skip the files it already has "
                      "a successful line for.")
RESUME_ASK = typer.Option(None, "--resume", help="The --jsonl output of an earlier run: skip the questions it "
                          "already answered about the same documents.")


def check_resume(out: OutputOptions) -> None:
    """--resume reads an earlier run's --jsonl output, so this run must write --jsonl too."""
    if not out.jsonl:
        raise BadArgument("--resume needs --jsonl (it reads an earlier run's --jsonl output)")


def done_lines(path: str) -> list[dict]:
    """The successful lines (a source and a text, no error) of a --jsonl file; a missing file has none."""
    p = Path(path)
    if p.is_dir():
        raise BadArgument(f"--resume {path}: is a directory")
    lines = read_regular_file(p).decode("utf-8", errors="replace").splitlines() if p.exists() else []
    done = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:  # e.g. a last line cut short by a killed run
            continue
        if isinstance(obj, dict) and "error" not in obj and isinstance(obj.get("source"), str) \
                and isinstance(obj.get("text"), str):
            done.append(obj)
    return done


def done_sources(path: str) -> set[str]:
    """Sources with a successful line in a --jsonl file."""
    return {obj["source"] for obj in done_lines(path)}


def done_questions(path: str, sources: list[str]) -> set[str]:
    """Questions with a successful line in a --jsonl file about the same documents (`sources`, in
    order: compared as given, then as real paths)."""
    def same(line_source: str) -> bool:
        if line_source == ", ".join(sources):
            return True
        parts = line_source.split(", ")
        return len(parts) == len(sources) and all(p == s or (s != "-" and os.path.realpath(p) == os.path.realpath(s))
                                                  for p, s in zip(parts, sources))
    return {obj["question"] for obj in done_lines(path) if isinstance(obj.get("question"), str) and same(obj["source"])}


def not_done(files: list[str], done: set[str]) -> list[str]:
    """The files without a successful line: compared as given, then as real paths (stdin never is done)."""
    real = {os.path.realpath(d) for d in done if d != "-"}
    return [f for f in files if f == "-" or (f not in done and os.path.realpath(f) not in real)]


def read_questions(path: str) -> list[str]:
    """--questions FILE: one question per line, blank lines skipped; - reads stdin."""
    if path == "-":
        raw = getattr(sys.stdin, "buffer", None)
        text = decode_text(raw.read()) if raw is not None else sys.stdin.read()
    else:
        p = Path(path)
        if p.is_dir():
            raise BadArgument(f"--questions {path}: is a directory")
        if not p.exists():
            raise InputNotFound(f"{path}: no such file")
        try:
            text = read_regular_file(p).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadArgument(f"--questions {path}: cannot be read ({exc})") from None
    questions = [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise BadArgument(f"--questions {path}: no questions in the file")
    return questions
