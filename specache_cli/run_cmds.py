"""`specache summarize` and `specache ask`."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from engine.config import CacheConfig, GenerationConfig
from engine.docstore.store import KVStore, max_bytes_from
from engine.errors import (
    BadArgument,
    BatchFailures,
    EmptyDocument,
    InputNotFound,
    SpecacheError,
)
from engine.inputs.documents import load_document
from engine.jobs.pipeline import STRATEGIES, Failed, Runner, ask_many, summarize_many
from engine.model.loading import load_model
from engine.plan.profiles import model_defaults
from specache_cli.console import err_console, guarded
from specache_cli.options import (
    CacheOptions,
    GenerationOptions,
    ModelOptions,
    OutputOptions,
    grouped,
)
from specache_cli.render import emit_json, print_timings, progress_bar, render_jobs


def parse_batch(batch: str) -> int | None:
    """--batch: 'auto' (None: the planner decides) or a positive integer."""
    if batch == "auto":
        return None
    if not batch.isdigit() or int(batch) < 1:
        raise BadArgument(f"--batch must be 'auto' or a positive integer, not {batch!r}")
    return int(batch)


class Session:
    """Flags validated up front; the model loaded on first use (so bad flags and unreadable
    documents are reported before any model load)."""

    def __init__(self, model: ModelOptions, cache: CacheOptions, gen: GenerationOptions, quiet: bool):
        if gen.strategy not in STRATEGIES:
            raise BadArgument(f"--strategy must be one of {', '.join(STRATEGIES)}, not {gen.strategy!r}")
        self.overrides = dict(bits=cache.bits, group=cache.group, k=cache.k, residual=cache.residual,
                              sinks=cache.sinks, chunk_size=cache.chunk_size, measure_hits=cache.hit_rate or None,
                              prefetch=cache.prefetch, gamma=cache.gamma)
        CacheConfig(mode=cache.cache).with_overrides(**self.overrides)  # validate now
        self.model_opts, self.cache_opts, self.quiet = model, cache, quiet
        self.gen = GenerationConfig(max_tokens=gen.max_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                    seed=gen.seed)
        self.strategy, self.batch = gen.strategy, parse_batch(gen.batch)
        try:
            self.store_max_bytes = max_bytes_from(cache.cache_max_gb)
        except ValueError as exc:
            raise BadArgument(f"--cache-max-gb: {exc}") from None
        self._runner: Runner | None = None

    def status(self, message: str) -> None:
        if not self.quiet:
            err_console.print(f"[dim]{message}[/]", highlight=False)

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            m = self.model_opts
            lm = load_model(m.model, device=m.device, dtype=m.dtype, on_status=self.status)
            self.status(f"model {lm.name} on {lm.device} ({lm.dtype}) loaded in {lm.load_seconds:.1f} s")
            defaults = model_defaults(lm, self.overrides.get("prefetch"))
            cache = CacheConfig(mode=self.cache_opts.cache, **defaults).with_overrides(**self.overrides)
            self._runner = Runner(lm, cache, self.gen, self.strategy, self.batch, store=self.store())
        return self._runner

    def store(self) -> KVStore | None:
        """The persistent document store, unless --no-store."""
        if self.cache_opts.no_store:
            return None
        warn = lambda m: err_console.print(f"[yellow]warning:[/] {m}", highlight=False, soft_wrap=True)  # noqa: E731
        return KVStore(max_bytes=self.store_max_bytes, warn=warn, note=self.status)


def read_document(source: str, password: Optional[str], quiet: bool):
    """Read one document, with a page progress bar for PDFs."""
    with progress_bar(quiet) as bar:
        task = bar.add_task(f"reading {Path(source).name}", total=None)
        return load_document(source, password=password, stdin=sys.stdin,
                             on_page=lambda i, n: bar.update(task, completed=i + 1, total=n))


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


RESUME = typer.Option(None, "--resume", help="The --jsonl output of an earlier run: skip the files it already has "
                      "a successful line for.")


def done_sources(path: str) -> set[str]:
    """Sources with a successful line (no error) in a --jsonl file; a missing file has none."""
    p = Path(path)
    if p.is_dir():
        raise BadArgument(f"--resume {path}: is a directory")
    try:
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines() if p.exists() else []
    except OSError as exc:
        raise BadArgument(f"--resume {path}: cannot be read ({exc.strerror or exc})") from None
    done = set()
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:  # e.g. a last line cut short by a killed run
            continue
        if isinstance(obj, dict) and "error" not in obj and isinstance(obj.get("source"), str) \
                and isinstance(obj.get("text"), str):
            done.add(obj["source"])
    return done


def not_done(files: list[str], done: set[str]) -> list[str]:
    """The files without a successful line: compared as given, then as real paths (stdin never is done)."""
    real = {os.path.realpath(d) for d in done if d != "-"}
    return [f for f in files if f == "-" or (f not in done and os.path.realpath(f) not in real)]


def read_questions(path: str) -> list[str]:
    """--questions FILE: one question per line, blank lines skipped; - reads stdin."""
    if path == "-":
        text = sys.stdin.read()
    else:
        p = Path(path)
        if p.is_dir():
            raise BadArgument(f"--questions {path}: is a directory")
        if not p.exists():
            raise InputNotFound(f"{path}: no such file")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadArgument(f"--questions {path}: cannot be read ({exc})") from None
    questions = [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise BadArgument(f"--questions {path}: no questions in the file")
    return questions


def summarize_cmd(
    files: list[str] = typer.Argument(..., help="PDF, .txt or .md files; - reads stdin."),
    model: ModelOptions = None, cache: CacheOptions = None, gen: GenerationOptions = None, out: OutputOptions = None,
    resume: Optional[str] = RESUME,
) -> None:
    """Summarize each document (several documents are decoded together in batches)."""
    session = Session(model, cache, gen, out.quiet)
    quiet, structured, jsonl = out.quiet, out.structured, out.jsonl
    many = len(files) > 1
    if resume is not None:
        if not jsonl:
            raise BadArgument("--resume needs --jsonl (it reads an earlier run's --jsonl output)")
        done = done_sources(resume)
        todo = not_done(files, done)
        session.status(f"--resume: skipping {len(files) - len(todo)} of {len(files)} files already done in {resume}")
        files = todo
        if not files:
            return
    docs, errors = [], {}
    for i, source in enumerate(files):
        try:
            doc = read_document(source, out.password, quiet)
            if not doc.text.strip():  # checked here so the file gets its own error line in a batch
                raise EmptyDocument(f"{source}: the document is empty")
            docs.append((i, doc))
        except SpecacheError as exc:
            if not many:
                raise
            errors[i] = exc
    stream = not many and not structured
    good = iter(render_jobs(summarize_many(session.runner, [(d.text, d.source) for _, d in docs], stream=stream),
                            quiet, stream)) if docs else iter(())
    for i, source in enumerate(files):
        item = errors.get(i) or next(good)
        if isinstance(item, Failed):
            if not many:
                raise item.error
            item = errors[i] = item.error
        if isinstance(item, SpecacheError):
            err_console.print(f"[bold red]error:[/] {item}", highlight=False, soft_wrap=True)
            if structured:
                emit_json({"source": source, "error": {"code": item.code, "exit_code": item.exit_code,
                                                       "message": str(item)}}, jsonl)
            continue
        output([item], structured, jsonl, quiet, header=not stream)
    if errors:
        raise BatchFailures(f"{len(errors)} of {len(files)} documents failed")


def ask_cmd(
    question: Optional[str] = typer.Argument(None, help="The question."),
    doc: list[str] = typer.Option(..., "--doc", "-d", help="Document(s) forming the corpus; repeat for several."),
    questions: list[str] = typer.Option([], "--question", "-q", help="More questions; repeat for several."),
    questions_file: Optional[str] = typer.Option(None, "--questions", help="A file with one question per line "
                                                 "(all answered as decode batches sharing one prefill)."),
    model: ModelOptions = None, cache: CacheOptions = None, gen: GenerationOptions = None, out: OutputOptions = None,
) -> None:
    """Answer questions about a document or a corpus of documents (several questions share one prefill)."""
    asked = ([question] if question else []) + list(questions)
    if questions_file is not None:
        asked += read_questions(questions_file)
    if not asked:
        raise BadArgument("ask needs a question: specache ask --doc FILE \"question\"")
    if any(not q.strip() for q in asked):
        raise BadArgument("a question is empty")
    session = Session(model, cache, gen, out.quiet)
    quiet, structured, jsonl = out.quiet, out.structured, out.jsonl
    docs = [read_document(source, out.password, quiet) for source in doc]
    text = docs[0].text if len(docs) == 1 else "\n\n".join(f"=== {d.source} ===\n{d.text}" for d in docs)
    source = ", ".join(d.source for d in docs)
    stream = len(asked) == 1 and not structured
    results = render_jobs(ask_many(session.runner, text, source, asked, stream=stream), quiet, stream)
    output(results, structured, jsonl, quiet, header=not stream)


def register(app: typer.Typer) -> None:
    app.command("summarize")(guarded(grouped(summarize_cmd)))
    app.command("ask")(guarded(grouped(ask_cmd)))
