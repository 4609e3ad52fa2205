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
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from engine.errors import BadArgument, SpecacheError
from engine.jobs.pipeline import Failed, Result, Runner, ask_many, summarize_many
from engine.jobs.tasks import FailedQuestion, Task, ask_tasks, group_size, summarize_tasks

RAY_EXTRA = "pip install 'specache[ray]'"
MAX_RESTARTS = 3  # restarts of one actor before it is given up
RESTART_POLL_SECONDS = 0.25  # how often to ask whether a restarting actor is back
OBJECT_STORE_MB = 256  # a local runtime's shared-memory object store: documents and results are small

__all__ = ["Task", "FailedQuestion", "group_size", "summarize_tasks", "ask_tasks", "WorkerConfig", "WorkerState",
           "Tick", "Retry", "WorkerDied", "WorkerError", "import_ray", "start_local_ray", "validate", "run_job"]


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


@dataclass
class _Schedule:
    """run_job's bookkeeping: the actors and their states, the tasks still to hand out (longest first), the
    idle actors, the calls in flight (ref -> (actor, task; None for a model load or a restart check)) and
    the restarting actors (actor -> when to ask again whether it is back)."""

    actors: list
    states: list[WorkerState]
    queue: deque
    keys: Iterator[int]  # task keys for retries
    idle: list[int] = field(default_factory=list)
    running: dict = field(default_factory=dict)
    restarting: dict[int, float] = field(default_factory=dict)

    def busy(self) -> bool:
        return bool(self.queue) or any(task is not None for _, task in self.running.values())

    def moved(self, i: int, **changes) -> WorkerState:
        """Actor i's state with these changes, since now."""
        self.states[i] = replace(self.states[i], **changes, since=time.monotonic())
        return self.states[i]


def run_job(tasks: list[Task], make_runner: Callable[[], Runner], config: WorkerConfig,
            ) -> Iterator[WorkerState | Retry | Tick | Result | Failed]:
    """Run tasks on config.workers actors; yield worker states, retries and each Result / Failed
    as it completes (a Tick about every second in between). Raises the model-load error of an
    actor (the job cannot run) and SpecacheError when every actor is gone. On KeyboardInterrupt
    (or the consumer closing the generator) the actors are killed; Ray is shut down when this
    job started it."""
    validate(config)
    ray = import_ray()
    started = connect(ray, config)
    actors = []
    try:
        threads, gpus = resources(ray, config)
        remote = ray.remote(DocWorker).options(num_cpus=threads, num_gpus=gpus, max_restarts=config.max_restarts,
                                               max_task_retries=0)
        actors = [remote.remote(make_runner, threads) for _ in range(config.workers)]
        job = _Schedule(actors, [WorkerState(i, "starting", since=time.monotonic()) for i in range(config.workers)],
                        deque(tasks), iter(range(len(tasks), 2**62)))
        yield from job.states
        job.running = {a.ready.remote(): (i, None) for i, a in enumerate(actors)}
        while job.busy():
            yield from _hand_out(job)
            ref = _next_done(ray, job)
            if ref is None:
                yield Tick()
                continue
            yield from _settle(ray, job, ref)
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


def _hand_out(job: _Schedule) -> Iterator[WorkerState]:
    """The next tasks to the idle actors."""
    while job.idle and job.queue:
        i, task = job.idle.pop(0), job.queue.popleft()
        job.running[job.actors[i].run.remote(task)] = (i, task)
        yield job.moved(i, state="working", task=task.label)


def _next_done(ray, job: _Schedule):
    """The ref of a call that finished within about a second, or None; the restarting actors that are due
    are asked again. Raises SpecacheError when no actor is left."""
    now = time.monotonic()
    for i in [i for i, due in job.restarting.items() if due <= now]:
        del job.restarting[i]
        job.running[job.actors[i].ready.remote()] = (i, None)
    if not job.running and not job.restarting:
        raise SpecacheError("every worker died; see the errors above")
    wait = min([1.0] + [due - now for due in job.restarting.values()])
    ready, _ = ray.wait(list(job.running), num_returns=1, timeout=max(wait, 0.0)) if job.running else \
        ([], time.sleep(max(wait, 0.0)))
    return ready[0] if ready else None


def _settle(ray, job: _Schedule, ref) -> Iterator[WorkerState | Retry | Result | Failed]:
    """What a finished call means: a loaded model, a task's results, a task's documents failed, or its actor
    dead (the task retried or failed; the actor restarting, back later, or gone)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

    i, task = job.running.pop(ref)
    try:
        value = ray.get(ref)
    except ActorUnavailableError:  # asked while Ray restarts it: ask again shortly
        if task is None:
            job.restarting[i] = time.monotonic() + RESTART_POLL_SECONDS
            return
        value = None
        exc_text = "its process died"
    except ActorDiedError as exc:  # dead for good (restarts used up, or it cannot start)
        value, exc_text = None, died_reason(exc)
        if task is None:
            yield job.moved(i, state="gone", pid=None, task=None)
            return
    except RayActorError as exc:
        value, exc_text = None, died_reason(exc)
    except RayTaskError as exc:  # an exception inside the actor: these documents fail, the job goes on
        if task is None:
            raise as_error("a worker", exc) from None
        value = [failed(s, q, as_error(s, exc)) for s, q in task.units()]
    if value is None:  # the process running the task died (killed, out of memory)
        yield from _lost(job, i, task, exc_text)
        return
    if task is None:  # the actor has loaded the model
        if value["error"] is not None:
            raise value["error"]
        state = job.moved(i, state="ready", pid=value["pid"], node=value["node"], device=value["device"],
                          threads=value["threads"])
    else:
        state = job.moved(i, state="idle", task=None, done=job.states[i].done + len(value))
    job.idle.append(i)
    yield state
    if task is not None:
        yield from value


def _lost(job: _Schedule, i: int, task: Task, exc_text: str) -> Iterator[WorkerState | Retry | Failed]:
    """Actor i died running task: its documents are queued again one by one, or fail on a second death; the
    actor is asked again once Ray has restarted it (or it is gone)."""
    if task.attempt == 1:
        job.queue.extendleft(reversed(task.split(lambda: next(job.keys))))
        yield Retry(i, task.label, len(task.units()), exc_text)
    else:
        for source, question in task.units():
            yield failed(source, question, WorkerDied(f"{source}: the worker died twice on this document ({exc_text})"))
    yield job.moved(i, state="restarting", pid=None, task=None)
    job.running[job.actors[i].ready.remote()] = (i, None)  # back when Ray has restarted it, or gone


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
