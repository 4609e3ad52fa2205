"""Batch jobs on Ray: N actors, each holding one loaded model, run the single-process pipeline
(`summarize_many` / `ask_many` with the document store) on the documents they are handed.

Ray does the work a process pool and a scheduler would: it starts the actors (one GPU each when
the cluster has GPUs, `threads` CPUs each otherwise), places them on the nodes of a cluster,
restarts an actor whose process dies and ships documents and results. This module only decides
what to hand out (longest documents first, in groups of similar length that the actor decodes as
one batch) and what a death means for a document (retried once on its own, then an error line).

Ray is an optional dependency (`pip install 'specache[ray]'`); it is imported only when a job
with workers starts, so the rest of specache never needs it.

A job is a generator of events, rendered by the CLI:
    WorkerState   an actor's state changed (starting, ready, working on ..., restarting, gone)
    Retry         a task's actor died; its documents go back in the queue one by one
    Result        one finished document (or question), the same object the single-process path yields
    Failed        one document (or question) that could not be done
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from engine.errors import BadArgument, SpecacheError
from engine.jobs.pipeline import Failed, Result, Runner, ask_many, summarize_many

RAY_EXTRA = "pip install 'specache[ray]'"
CHARS_PER_TOKEN = 4  # the token estimate used to order documents (the driver holds no tokenizer)
DEFAULT_GROUP = 4  # documents handed to an actor at once (decoded together) when --batch is auto
MAX_RESTARTS = 3  # restarts of one actor before it is given up
RESTART_POLL_SECONDS = 0.25  # how often to ask whether a restarting actor is back
OBJECT_STORE_MB = 256  # a local runtime's shared-memory object store: documents and results are small


class WorkerDied(SpecacheError):
    """The actor running this document died twice (killed, out of memory, crashed)."""

    exit_code = 1
    code = "worker_died"


class WorkerError(SpecacheError):
    """An unexpected exception inside an actor while it ran this document (a bug, not bad input)."""

    exit_code = 1
    code = "worker_error"


def import_ray():
    """The ray module, or BadArgument (exit 2) naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise BadArgument(f"--workers needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


# ---- what is handed out ----------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """Documents handed to one actor at once.

    kind "summarize": docs are (text, source) pairs, summarized together (one decode batch when
    they fit the window). kind "ask": one (text, source) corpus and the questions to answer on it.
    attempt: 1 the first time, 2 for the retry after the actor running it died."""

    key: int
    kind: str
    docs: tuple[tuple[str, str], ...]
    questions: tuple[str, ...] = ()
    attempt: int = 1

    @property
    def tokens(self) -> int:
        """Estimated document tokens (characters / 4), the order documents are handed out in."""
        return sum(estimate_tokens(text) for text, _ in self.docs)

    @property
    def label(self) -> str:
        names = [Path(s).name or s for _, s in self.docs]
        what = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1}"
        if self.kind == "ask":
            what += f" ({len(self.questions)} question{'s' * (len(self.questions) != 1)})"
        return what

    def units(self) -> list[tuple[str, str | None]]:
        """(source, question) of every result this task yields."""
        if self.kind == "ask":
            return [(self.docs[0][1], q) for q in self.questions]
        return [(s, None) for _, s in self.docs]

    def split(self, next_key: Callable[[], int]) -> list["Task"]:
        """One task per document (per question for ask), as a retry: a second death then names one."""
        if self.kind == "ask":
            return [Task(next_key(), "ask", self.docs, (q,), attempt=2) for q in self.questions]
        return [Task(next_key(), "summarize", (d,), attempt=2) for d in self.docs]


def estimate_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN + 1


def group_size(n: int, workers: int, batch: int | None) -> int:
    """Documents per task: --batch when given, else DEFAULT_GROUP, but small enough that every
    worker gets about two tasks (so the last ones to finish are short)."""
    want = batch if batch is not None else DEFAULT_GROUP
    return max(1, min(want, math.ceil(n / (2 * workers))))


def summarize_tasks(docs: Sequence[tuple[str, str]], workers: int, batch: int | None) -> list[Task]:
    """(text, source) documents -> tasks, longest first; each task holds documents of similar length."""
    order = sorted(docs, key=lambda d: estimate_tokens(d[0]), reverse=True)
    size = group_size(len(order), workers, batch)
    return [Task(i, "summarize", tuple(order[j:j + size])) for i, j in enumerate(range(0, len(order), size))]


def ask_tasks(text: str, source: str, questions: Sequence[str], workers: int, batch: int | None) -> list[Task]:
    """Questions on one corpus -> tasks of a few questions each (an actor answers them as one batch
    sharing the corpus prefill; with the store on, the corpus is prefilled once per machine)."""
    size = group_size(len(questions), workers, batch)
    return [Task(i, "ask", ((text, source),), tuple(questions[j:j + size]))
            for i, j in enumerate(range(0, len(questions), size))]


@dataclass
class FailedQuestion(Failed):
    """A question of ask that could not be answered (its error line names the question)."""

    question: str | None = None


# ---- the actor -------------------------------------------------------------------------------

class DocWorker:
    """One Ray actor: loads the model once (make_runner), then runs tasks on it.

    A SpecacheError while loading (a bad --model, say) is kept and reported by ready(), so the
    driver can fail the job with that error instead of restarting the actor for ever."""

    def __init__(self, make_runner: Callable[[], Runner], threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.runner: Runner | None = None
        self.error: SpecacheError | None = None
        try:
            self.runner = make_runner()
        except SpecacheError as exc:
            self.error = exc

    def ready(self) -> dict:
        """pid, device and threads of this actor, or the error its model load raised."""
        import torch

        device = str(self.runner.lm.device) if self.runner is not None else None
        return {"pid": os.getpid(), "node": os.uname().nodename, "device": device,
                "threads": torch.get_num_threads(), "error": self.error}

    def run(self, task: Task) -> list[Result | Failed]:
        """Every Result / Failed of the task (progress events are dropped: the driver shows documents)."""
        if self.runner is None:
            raise self.error
        if task.kind == "summarize":
            events = summarize_many(self.runner, list(task.docs))
            return [e for e in events if isinstance(e, (Result, Failed))]
        (text, source), = task.docs
        try:
            return [e for e in ask_many(self.runner, text, source, list(task.questions)) if isinstance(e, Result)]
        except SpecacheError as exc:
            return [FailedQuestion(source, exc, q) for q in task.questions]


# ---- the job ---------------------------------------------------------------------------------

@dataclass
class WorkerState:
    """An actor's state: starting, ready, working, restarting, idle, gone."""

    index: int
    state: str
    pid: int | None = None
    node: str | None = None
    task: str | None = None  # what it is working on
    since: float = 0.0
    done: int = 0  # results it has returned
    device: str | None = None
    threads: int | None = None


@dataclass
class Tick:
    """Nothing finished in the last second (lets a display refresh its clocks)."""


@dataclass
class Retry:
    """The actor running `task` died; its documents are queued again one by one."""

    worker: int
    task: str
    units: int
    reason: str


@dataclass
class WorkerConfig:
    """How the job uses Ray. address None: a local runtime started for the job (and shut down
    after); 'auto' or HOST:PORT: join that cluster. threads: torch threads per actor (None: the
    cores divided among the actors). gpus: one GPU per actor (None: when the cluster has GPUs
    and device is not cpu)."""

    workers: int
    address: str | None = None
    threads: int | None = None
    device: str = "auto"
    quiet: bool = False
    object_store_mb: int = OBJECT_STORE_MB
    gpus: bool | None = None
    max_restarts: int = MAX_RESTARTS


def validate(config: WorkerConfig) -> None:
    if config.workers < 1:
        raise BadArgument(f"--workers must be at least 1, not {config.workers}")
    if config.threads is not None and config.threads < 1:
        raise BadArgument(f"--threads-per-worker must be at least 1, not {config.threads}")


def code_root() -> str:
    """The folder holding the `engine` package this driver runs, so local actors import the same code."""
    return str(Path(__file__).resolve().parents[2])


def start_local_ray(ray, num_cpus: int, object_store_mb: int = OBJECT_STORE_MB, quiet: bool = False) -> None:
    """A private local Ray runtime (no dashboard, a small object store) whose worker processes
    import this checkout's code first (PYTHONPATH set for the processes Ray starts)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (code_root(), old) if p)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=object_store_mb * 2**20, log_to_driver=not quiet,
                 logging_level=logging.ERROR if quiet else logging.WARNING)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def connect(ray, config: WorkerConfig) -> bool:
    """Start or join Ray for the job; True when this call started it (and must shut it down)."""
    if ray.is_initialized():  # a library user or the tests started it
        return False
    if config.address is None:
        cores = os.cpu_count() or 1
        start_local_ray(ray, max(cores, config.workers * (config.threads or 1)), config.object_store_mb,
                        config.quiet)
    else:
        try:
            ray.init(address=config.address, log_to_driver=not config.quiet,
                     logging_level=logging.ERROR if config.quiet else logging.WARNING)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise BadArgument(f"--ray-address {config.address}: cannot join the Ray cluster ({exc})") from None
    return True


def resources(ray, config: WorkerConfig) -> tuple[int, int]:
    """(CPUs, GPUs) per actor, checked against the cluster's totals."""
    total = ray.cluster_resources()
    cpus, gpus = int(total.get("CPU", 0)), int(total.get("GPU", 0))
    use_gpu = config.gpus if config.gpus is not None else (gpus > 0 and config.device != "cpu")
    if config.device.startswith("cuda") and not gpus:
        raise BadArgument("--device cuda with --workers: the Ray cluster has no GPU")
    if use_gpu and gpus < config.workers:
        raise BadArgument(f"--workers {config.workers}: each worker takes one GPU and the Ray cluster has {gpus}")
    threads = config.threads or max(1, cpus // config.workers)
    if threads * config.workers > cpus:
        raise BadArgument(f"--workers {config.workers} x {threads} threads need {threads * config.workers} CPUs; "
                          f"the Ray cluster has {cpus}")
    return threads, int(use_gpu)


def run_job(tasks: list[Task], make_runner: Callable[[], Runner], config: WorkerConfig,
            ) -> Iterator[WorkerState | Retry | Tick | Result | Failed]:
    """Run tasks on config.workers actors; yield worker states, retries and each Result / Failed
    as it completes (a Tick about every second in between). Raises the model-load error of an
    actor (the job cannot run) and SpecacheError when every actor is gone. On KeyboardInterrupt
    (or the consumer closing the generator) the actors are killed; Ray is shut down when this
    job started it."""
    validate(config)
    ray = import_ray()
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

    started = connect(ray, config)
    actors = []
    try:
        threads, gpus = resources(ray, config)
        remote = ray.remote(DocWorker).options(num_cpus=threads, num_gpus=gpus, max_restarts=config.max_restarts,
                                               max_task_retries=0)
        actors = [remote.remote(make_runner, threads) for _ in range(config.workers)]
        states = [WorkerState(i, "starting", since=time.monotonic()) for i in range(config.workers)]
        yield from states
        keys = iter(range(len(tasks), 2**62))
        queue = deque(tasks)  # longest first
        idle: list[int] = []
        running: dict = {a.ready.remote(): (i, None) for i, a in enumerate(actors)}  # ref -> (actor, task)
        restarting: dict[int, float] = {}  # actor -> when to ask again whether it is back
        while queue or any(task is not None for _, task in running.values()):
            while idle and queue:
                i, task = idle.pop(0), queue.popleft()
                running[actors[i].run.remote(task)] = (i, task)
                states[i] = replace(states[i], state="working", task=task.label, since=time.monotonic())
                yield states[i]
            now = time.monotonic()
            for i in [i for i, due in restarting.items() if due <= now]:
                del restarting[i]
                running[actors[i].ready.remote()] = (i, None)
            if not running and not restarting:
                raise SpecacheError("every worker died; see the errors above")
            wait = min([1.0] + [due - now for due in restarting.values()])
            ready, _ = ray.wait(list(running), num_returns=1, timeout=max(wait, 0.0)) if running else \
                ([], time.sleep(max(wait, 0.0)))
            if not ready:
                yield Tick()
                continue
            i, task = running.pop(ready[0])
            try:
                value = ray.get(ready[0])
            except ActorUnavailableError:  # asked while Ray restarts it: ask again shortly
                if task is None:
                    restarting[i] = time.monotonic() + RESTART_POLL_SECONDS
                    continue
                value = None
                exc_text = "its process died"
            except ActorDiedError as exc:  # dead for good (restarts used up, or it cannot start)
                value, exc_text = None, died_reason(exc)
                if task is None:
                    states[i] = replace(states[i], state="gone", pid=None, task=None, since=time.monotonic())
                    yield states[i]
                    continue
            except RayActorError as exc:
                value, exc_text = None, died_reason(exc)
            except RayTaskError as exc:  # an exception inside the actor: these documents fail, the job goes on
                if task is None:
                    raise as_error("a worker", exc) from None
                value = [failed(s, q, as_error(s, exc)) for s, q in task.units()]
            if value is None:  # the process running the task died (killed, out of memory)
                if task.attempt == 1:
                    queue.extendleft(reversed(task.split(lambda: next(keys))))
                    yield Retry(i, task.label, len(task.units()), exc_text)
                else:
                    for source, question in task.units():
                        yield failed(source, question, WorkerDied(
                            f"{source}: the worker died twice on this document ({exc_text})"))
                states[i] = replace(states[i], state="restarting", pid=None, task=None, since=time.monotonic())
                yield states[i]
                running[actors[i].ready.remote()] = (i, None)  # back when Ray has restarted it, or gone
                continue
            if task is None:  # the actor has loaded the model
                if value["error"] is not None:
                    raise value["error"]
                states[i] = replace(states[i], state="ready", pid=value["pid"], node=value["node"],
                                    device=value["device"], threads=value["threads"], since=time.monotonic())
            else:
                states[i] = replace(states[i], state="idle", task=None, since=time.monotonic(),
                                    done=states[i].done + len(value))
            idle.append(i)
            yield states[i]
            if task is not None:
                yield from value
    except BaseException:
        for actor in actors:  # Ctrl-C, a closed generator, an error: stop the work now
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        raise
    finally:
        if started:
            ray.shutdown()


def failed(source: str, question: str | None, error: SpecacheError) -> Failed:
    """A Failed document, or a FailedQuestion of ask."""
    return Failed(source, error) if question is None else FailedQuestion(source, error, question)


def as_error(source: str, exc: Exception) -> SpecacheError:
    """The typed error an actor raised, else a WorkerError with the exception's first line."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, SpecacheError):
        return cause
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return WorkerError(f"{source}: {type(cause).__name__}: {first}")


def died_reason(exc: Exception) -> str:
    """A few words on why an actor died, from Ray's error text."""
    text = str(exc).lower()
    if "memory" in text or "oom" in text:
        return "out of memory"
    if "sigkill" in text or "killed" in text or "signal" in text:
        return "its process was killed"
    return "its process died"
