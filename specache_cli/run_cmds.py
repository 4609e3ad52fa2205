"""`specache summarize` and `specache ask`."""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
import sys
from dataclasses import replace
from typing import Optional

import torch
import typer

from engine.config import CacheConfig, settings
from engine.docstore.store import DocStore, check_folder, max_bytes_from
from engine.errors import (
    BadArgument,
    BatchFailures,
    EmptyDocument,
    ModelLoadError,
    ProfileError,
    SpecacheError,
)
from engine.inputs.documents import STDIN
from engine.jobs.pipeline import STRATEGIES, Failed, Runner, ask_many, count_tokens, summarize_many
from engine.jobs.workers import WorkerConfig, ask_tasks, import_ray, run_job, summarize_tasks, validate
from engine.kvcache import policy
from engine.model.files import model_files
from engine.model.loading import estimate_weight_bytes, load_model
from engine.plan.planner import check_fits_before_load
from engine.paths import cache_root
from engine.plan.profiles import model_defaults
from engine.plan.threads import choose_threads
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


DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", "float32", "float16", "bfloat16")
PROMPT_SLACK = 512  # tokens a prompt may add around the document and question (chat template, labels)
# the settings that size buffers in tokens (engine.config.Setting.tokens): bounded by the model's window
WINDOW_FLAGS = {name: declared for name, declared in settings().items() if declared.tokens}


def check_device(device: str, dtype: str) -> None:
    """--device and --dtype, before anything is loaded: names only, and CUDA only where there is one."""
    if not DEVICES.fullmatch(device):
        raise BadArgument(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}")
    if dtype not in DTYPES:
        raise BadArgument(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ModelLoadError(f"--device {device} was asked for but no CUDA device is available")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise BadArgument(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s)")


def check_window(cache: CacheOptions, max_tokens: int, window: int) -> None:
    """Flags that size buffers in tokens, against the model's window: none may exceed it (a bigger
    value could only waste memory), and --max-tokens leaves at least half the window to the document."""
    for field, declared in WINDOW_FLAGS.items():
        value = getattr(cache, field)
        if value is not None and value > window:
            raise BadArgument(f"{declared.flag} {value} is more than the model's window of {window} tokens "
                              f"(at most {window})")
    if max_tokens > window // 2:
        raise BadArgument(f"--max-tokens {max_tokens} leaves too little of the model's {window}-token window for "
                          f"the document (at most {window // 2})")


def clamp_to_prompt(config: CacheConfig, longest: int) -> tuple[CacheConfig, list[str]]:
    """The cache settings with k, sinks, residual and chunk_size cut to `longest` (tokens of the
    longest model call: prompt and answer); beyond it they change nothing but the size of buffers.
    -> (config, the flags cut, as "--k 5000")."""
    cut, notes = {}, []
    for field, declared in WINDOW_FLAGS.items():
        value = getattr(config, field)
        if value > longest:
            cut[field] = max(longest, declared.low or 1)
            if cut[field] < value:
                notes.append(f"{declared.flag} {value}")
    return (replace(config, **cut) if cut else config), notes


def check_stdin_once(sources: list[str], questions_file: str | None = None) -> None:
    """Standard input can be read once: "-" given twice (or for documents and --questions) is refused."""
    if sources.count(STDIN) + (questions_file == STDIN) > 1:
        raise BadArgument('standard input ("-") can be read only once: give it for one document, '
                          "or for --questions, not both")


class Session:
    """Flags validated up front; the model loaded on first use (so bad flags and unreadable
    documents are reported before any model load)."""

    def __init__(self, model: ModelOptions, cache: CacheOptions, gen: GenerationOptions, quiet: bool):
        if gen.strategy not in STRATEGIES:
            raise BadArgument(f"--strategy must be one of {', '.join(STRATEGIES)}, not {gen.strategy!r}")
        check_device(model.device, model.dtype)
        self.overrides = cache.overrides()
        self.policy = policy(cache.cache)  # the mode's class, resolved once: a registered mode (BadArgument)
        CacheConfig(mode=cache.cache).with_overrides(**self.overrides)  # the settings, checked now
        self.model_opts, self.cache_opts, self.quiet = model, cache, quiet
        self.gen = gen.config()
        self.strategy, self.batch = gen.strategy, parse_batch(gen.batch)
        try:
            self.store_max_bytes = max_bytes_from(cache.cache_max_gb)
        except ValueError as exc:
            raise BadArgument(f"--cache-max-gb: {exc}") from None
        self.files = model_files(model.model, self.status)  # --model resolved once for the command
        check_window(cache, gen.max_tokens, self.files.window)
        if self.files.source.kind == "embedded" or not cache.no_store:  # the converted model and the store live there
            check_folder(cache_root())
        self.longest_text = ""  # the longest document (and question) read: bounds the cache flags
        self._runner: Runner | None = None
        self.pick_threads = True  # False in a worker's copy: its threads come from --threads-per-worker

    def status(self, message: str) -> None:
        if not self.quiet:
            err_console.print(f"[dim]{message}[/]", highlight=False)

    def saw(self, *texts: str) -> None:
        """Note the text of a document (or question) read, so the cache flags can be cut to its length."""
        self.longest_text = max((self.longest_text, *texts), key=len)

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            m = self.model_opts
            if self.pick_threads:
                self.set_threads(m.threads)
            self.check_fits()
            lm = load_model(self.files, device=m.device, dtype=m.dtype, on_status=self.status, on_warning=print_warning)
            self.status(f"model {lm.name} on {lm.device} ({lm.dtype}) loaded in {lm.load_seconds:.1f} s")
            defaults = model_defaults(lm, self.overrides.get("prefetch"))
            cache = CacheConfig(mode=self.cache_opts.cache, **defaults).with_overrides(**self.overrides)
            floor = min(lm.max_context, self.gen.max_tokens + PROMPT_SLACK)  # no call is shorter than this bound
            if any(getattr(cache, f) > floor for f in WINDOW_FLAGS):  # (counting tokens costs ~1 s per 100k)
                longest = min(lm.max_context, count_tokens(lm.tokenizer, self.longest_text) + floor)
                cache, notes = clamp_to_prompt(cache, longest)
                if notes:
                    self.status(f"{', '.join(notes)}: cut to {longest} tokens, the longest model call here")
            self._runner = Runner(lm, cache, self.gen, self.strategy, self.batch, store=self.store(),
                                  policy=self.policy)
        return self._runner

    def check_fits(self) -> None:
        """Before loading: the weights as they will be held and one sequence's cache of the longest
        call (its text counted at 4 characters a token, the least a tokenizer gives), with the settings
        given (--k, --residual, ...; the others by their default rule), must fit in memory."""
        m = self.model_opts
        if m.device.startswith("cuda") or (m.device == "auto" and torch.cuda.is_available()):
            return  # the GPU's check runs after loading (plan_for_run), with the device's own free memory
        files = self.files
        context = min(files.window, self.gen.max_tokens + PROMPT_SLACK + len(self.longest_text) // 4)
        try:
            check_fits_before_load(files.config, estimate_weight_bytes(files, m.dtype), context,
                                   self.policy, self.overrides, name=files.name)
        except ProfileError:
            return  # a config without the model's shapes: the load itself reports what is wrong

    def set_threads(self, requested: int | None) -> None:
        """torch's CPU threads for this run (engine.plan.threads: --threads, $OMP_NUM_THREADS or the
        free cores); a note on stderr when the machine is busy and fewer than its cores are used."""
        choice = choose_threads(requested)
        torch.set_num_threads(choice.threads)
        if choice.reason == "free cores" and choice.threads < choice.cores:
            self.status(f"the machine is busy ({choice.busy:.1f} of {choice.cores} cores in use by other work): "
                        f"{choice.threads} thread{'s' if choice.threads > 1 else ''} (--threads to choose)")

    def store(self) -> DocStore | None:
        """The persistent document store, unless --no-store; opening it applies its cap."""
        if self.cache_opts.no_store:
            return None
        store = DocStore(max_bytes=self.store_max_bytes, warn=print_warning, note=self.status)
        store.tidy()
        return store


def summarize_cmd(
    files: list[str] = typer.Argument(..., help="PDF, .txt or .md files; - reads stdin."),
    model: ModelOptions = None, cache: CacheOptions = None, gen: GenerationOptions = None, out: OutputOptions = None,
    resume: Optional[str] = RESUME, work: WorkerOptions = None,
) -> None:
    """Summarize each document (several documents are decoded together in batches)."""
    check_stdin_once(files)
    session = Session(model, cache, gen, out.quiet)
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
    session = Session(model, cache, gen, out.quiet)
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


def worker_runner(session: Session) -> Runner:
    """The Runner an actor builds from the driver's Session (quietly: the driver shows progress)."""
    own = copy.copy(session)
    own.quiet = True
    own.files = dataclasses.replace(session.files, on_status=None)
    own.pick_threads = False  # the actor's threads: --threads-per-worker
    return own.runner


def run_on_workers(session: Session, config: WorkerConfig, tasks, total: int, out: OutputOptions,
                   noun: str) -> int:
    """Run tasks on the workers, writing each result as it completes; the number that failed."""
    events = run_job(tasks, functools.partial(worker_runner, session), config)
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
