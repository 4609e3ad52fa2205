"""`specache summarize` and `specache ask`."""
from __future__ import annotations

import functools
import sys
from typing import Optional

import typer
from rich.markup import escape

from engine.errors import BadArgument, BatchFailures, EmptyDocument, SpecacheError
from engine.inputs.documents import STDIN
from engine.jobs.pipeline import Failed, Runner, ask_many, summarize_many
from engine.jobs.prepare import Notes, PreparedRun, RunRequest
from engine.jobs.workers import WorkerConfig, ask_tasks, import_ray, run_job, summarize_tasks, validate
from specache_cli.console import err_console, guarded, print_error, print_warning
from specache_cli.options import (
    CacheOptions,
    GenerationOptions,
    ModelOptions,
    OutputOptions,
    WorkerOptions,
    grouped,
)
from specache_cli.render import emit_json, render_jobs
from specache_cli.run_inputs import (
    RESUME,
    RESUME_ASK,
    check_resume,
    done_questions,
    done_sources,
    not_done,
    read_document,
    read_questions,
)
from specache_cli.run_output import output, write_item
from specache_cli.workers_view import render_job


def parse_batch(batch: str) -> int | None:
    """--batch: 'auto' (None: the planner decides) or a positive integer."""
    if batch == "auto":
        return None
    if not (batch.isascii() and batch.isdigit()) or int(batch) < 1:
        raise BadArgument(f"--batch must be 'auto' or a positive integer, not {batch!r}")
    return int(batch)


def check_stdin_once(sources: list[str], questions_file: str | None = None) -> None:
    """Standard input can be read once: "-" given twice (or for documents and --questions) is refused."""
    if sources.count(STDIN) + (questions_file == STDIN) > 1:
        raise BadArgument('standard input ("-") can be read only once: give it for one document, '
                          "or for --questions, not both")


class Session:
    """The flags of a run turned into a RunRequest and prepared up front (engine.jobs.prepare: the model
    resolved, the settings checked); progress on stderr unless --quiet, -v's resolution steps with -v."""

    def __init__(self, model: ModelOptions, cache: CacheOptions, gen: GenerationOptions, out: OutputOptions):
        self.quiet = out.quiet
        request = RunRequest(model=model.model, device=model.device, dtype=model.dtype, threads=model.threads,
                             mode=cache.cache, overrides=cache.overrides(), gen=gen.config(), strategy=gen.strategy,
                             batch=parse_batch(gen.batch), store=not cache.no_store, cache_max_gb=cache.cache_max_gb)
        notes = Notes(status=self.status, warning=print_warning, detail=self.detail if out.verbose else None)
        self.run = PreparedRun(request, notes)
        self.batch = request.batch

    def status(self, message: str) -> None:
        if not self.quiet:
            err_console.print(f"[dim]{message}[/]", highlight=False)

    @staticmethod
    def detail(message: str) -> None:
        err_console.print(f"[dim]-v {escape(message)}[/]", highlight=False, soft_wrap=True)

    def saw(self, *texts: str) -> None:
        self.run.saw(*texts)

    @property
    def runner(self) -> Runner:
        return self.run.runner


def summarize_cmd(
    files: list[str] = typer.Argument(..., help="PDF, .txt or .md files; - reads stdin."),
    model: ModelOptions = None, cache: CacheOptions = None, gen: GenerationOptions = None, out: OutputOptions = None,
    resume: Optional[str] = RESUME, work: WorkerOptions = None,
) -> None:
    """Summarize each document (several documents are decoded together in batches)."""
    check_stdin_once(files)
    session = Session(model, cache, gen, out)
    config = worker_config(work, model, out.quiet)
    quiet, structured, jsonl = out.quiet, out.structured, out.jsonl
    many = len(files) > 1
    if resume is not None:
        check_resume(out)
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
            session.saw(doc.text)
            docs.append((i, doc))
        except SpecacheError as exc:
            if not many:
                raise
            errors[i] = exc
    if config is not None:
        return summarize_on_workers(session, config, files, docs, errors, out)
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
            print_error(str(item))
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
    resume: Optional[str] = RESUME_ASK, work: WorkerOptions = None,
) -> None:
    """Answer questions about a document or a corpus of documents (several questions share one prefill)."""
    check_stdin_once(doc, questions_file)
    asked = ([question] if question else []) + list(questions)
    if questions_file is not None:
        asked += read_questions(questions_file)
    if not asked:
        raise BadArgument("ask needs a question: specache ask --doc FILE \"question\"")
    if any(not q.strip() for q in asked):
        raise BadArgument("a question is empty")
    if resume is not None:
        check_resume(out)
    session = Session(model, cache, gen, out)
    if resume is not None:
        done = done_questions(resume, doc)
        todo = [q for q in asked if q not in done]
        session.status(f"--resume: skipping {len(asked) - len(todo)} of {len(asked)} questions already answered "
                       f"in {resume}")
        asked = todo
        if not asked:
            return
    config = worker_config(work, model, out.quiet)
    quiet, structured, jsonl = out.quiet, out.structured, out.jsonl
    docs = [read_document(source, out.password, quiet) for source in doc]
    text = docs[0].text if len(docs) == 1 else "\n\n".join(f"=== {d.source} ===\n{d.text}" for d in docs)
    source = ", ".join(d.source for d in docs)
    session.saw(text + "\n" + max(asked, key=len))
    if config is not None:
        return ask_on_workers(session, config, text, source, asked, out)
    stream = len(asked) == 1 and not structured
    results = render_jobs(ask_many(session.runner, text, source, asked, stream=stream), quiet, stream)
    output(results, structured, jsonl, quiet, header=not stream)


# ---- --workers N: the same jobs on Ray actors (engine.jobs.workers) ---------------------------

def worker_config(opts: WorkerOptions, model: ModelOptions, quiet: bool) -> WorkerConfig | None:
    """--workers and friends checked up front (Ray installed, sane numbers); None without --workers."""
    if opts.workers is None:
        if opts.ray_address is not None or opts.threads_per_worker is not None:
            raise BadArgument("--ray-address and --threads-per-worker go with --workers N")
        return None
    if model.threads is not None:
        raise BadArgument("--threads is for a run without workers; with --workers use --threads-per-worker")
    config = WorkerConfig(workers=opts.workers, address=opts.ray_address, threads=opts.threads_per_worker,
                          device=model.device, quiet=quiet)
    validate(config)
    import_ray()
    return config


def worker_runner(run: PreparedRun) -> Runner:
    """The Runner an actor builds from the driver's preparation (its PreparedRun.for_worker copy)."""
    return run.runner


def run_on_workers(session: Session, config: WorkerConfig, tasks, total: int, out: OutputOptions,
                   noun: str) -> int:
    """Run tasks on the workers, writing each result as it completes; the number that failed."""
    events = run_job(tasks, functools.partial(worker_runner, session.run.for_worker()), config)
    return render_job(events, total, config.workers, out.quiet, functools.partial(write_item, out=out),
                      noun).failed


def summarize_on_workers(session: Session, config: WorkerConfig, files: list[str], docs: list, errors: dict,
                         out: OutputOptions) -> None:
    """summarize --workers N: unreadable files get their error line now, the rest go to the workers."""
    for i in sorted(errors):
        write_item(Failed(files[i], errors[i]), sys.stdout, out)
    failed = len(errors)
    if docs:
        tasks = summarize_tasks([(d.text, d.source) for _, d in docs], config.workers, session.batch)
        failed += run_on_workers(session, config, tasks, len(docs), out, "documents")
    if failed:
        raise BatchFailures(f"{failed} of {len(files)} documents failed")


def ask_on_workers(session: Session, config: WorkerConfig, text: str, source: str, asked: list[str],
                   out: OutputOptions) -> None:
    """ask --workers N: the questions are shared out among the workers (each prefills the corpus or
    loads it from the store)."""
    tasks = ask_tasks(text, source, asked, config.workers, session.batch)
    failed = run_on_workers(session, config, tasks, len(asked), out, "questions")
    if failed:
        raise BatchFailures(f"{failed} of {len(asked)} questions failed")


def register(app: typer.Typer) -> None:
    app.command("summarize")(guarded(grouped(summarize_cmd)))
    app.command("ask")(guarded(grouped(ask_cmd)))
