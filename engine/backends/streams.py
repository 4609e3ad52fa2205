"""A device's streams and events behind one object per device (streams_for), so that the code ordering
host <-> device transfers (the host store and its prefetch, the verification stream, graph replay) asks
one capability, `asynchronous` (the device has memory of its own and queues its work on streams while
the host runs ahead), and one set of calls, instead of testing for CUDA.

Three implementations of the interface Streams declares:

  SyncStreams     the CPU's: not asynchronous; the callers take their plain synchronous path and ask it
                  for nothing but bounded waits on a host thread's signal.
  CudaStreams     torch.cuda's own streams, events, pinned memory and graphs, unwrapped.
  StandinStreams  CUDA's orchestration run on CPU tensors, for the tests. A side stream is a deferred
                  queue of work, run in order only when something waits for it (so a read that does not
                  wait for its event sees what the work has not written yet); a test may hold a stream
                  back and release it. An event completes when the work queued on its stream before it
                  has run. The compute stream, and a side stream while its own work runs, is synchronous.
                  A wait that cannot complete (an event never recorded, a stream held back, a signal
                  never given) raises RuntimeError after a few seconds instead of hanging, and a recorded
                  pass that syncs the host (a stream or event wait, or a tensor's value read on the host)
                  or ends with work left on another stream raises too.

A stream has wait_event / wait_stream / synchronize, an event record / query / synchronize, as torch.cuda's.
Host waits on a CUDA event are not bounded (an event never recorded completes at once on CUDA: a missed
record is a wrong read, which the stand-in shows, not a hang); waits on another thread's signal are."""
from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from typing import Callable

import torch

from engine.backends.costs import RefuseHostReads

WAIT_SECONDS = 300.0  # a wait for another thread's signal on a real device: past this the signal is lost
STANDIN_WAIT_SECONDS = 5.0  # the stand-in's bound on every wait: what a test waits before it fails
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped (a device address too)


def wait_flag(flag: threading.Event, what: str, seconds: float) -> None:
    """Wait for another thread's signal; RuntimeError naming `what` when it has not come in `seconds`."""
    if not flag.wait(seconds):
        raise RuntimeError(f"{what}: no signal after {seconds:g} s (a lost signal: stopping rather than hanging)")


class Streams:
    """The interface, and the CPU's implementation of it (SyncStreams): nothing is queued, so there is
    nothing to wait for; a caller asking a synchronous device for a stream has a bug."""

    asynchronous = False  # the device has memory of its own and asynchronous streams
    records_graphs = False  # capture() records a pass that replay() runs again without the host
    kernels_of: str | None = None  # the device type whose backend (engine.backends.kernels) serves; None: its own

    def __init__(self, wait_seconds: float = WAIT_SECONDS):
        self.wait_seconds = wait_seconds

    def stream(self):
        """A new side stream."""
        raise RuntimeError("this device has no streams (Streams.asynchronous is False)")

    def event(self):
        """A new event (not recorded yet)."""
        raise RuntimeError("this device has no events (Streams.asynchronous is False)")

    def current_stream(self):
        """The stream the host's work is queued on now (the compute stream, or a side stream in launch)."""
        raise RuntimeError("this device has no streams (Streams.asynchronous is False)")

    def launch(self, stream, work: Callable[[], object]) -> object:
        """Queue what work() issues on `stream`. -> work()'s result where it runs now (CUDA: the launch's
        own result), True where it is deferred (the stand-in: it raises when it runs, if it returns False)."""
        return work()

    def synchronize(self) -> None:
        """Wait for everything queued on the device."""

    def pinned_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero host tensor that asynchronous copies may read and write (page-locked on CUDA)."""
        return torch.zeros(shape, dtype=dtype)

    def pin(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory in place, mapped into the device's address space. -> whether it was."""
        return False

    def unpin(self, address: int) -> None:
        """Undo pin (after synchronize: nothing may be in flight from or to it)."""

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Keep tensor's memory from reuse until the work queued on `stream` so far has run."""

    def wait_flag(self, flag: threading.Event, what: str) -> None:
        """Wait for another thread's signal, bounded (RuntimeError naming `what` past the bound)."""
        wait_flag(flag, what, self.wait_seconds)

    def capture(self, run: Callable[[], torch.Tensor]):
        """Record the pass run() issues. -> (graph: replay() runs it again, run()'s output tensor)."""
        raise RuntimeError("this device records no graphs (Streams.records_graphs is False)")


class SyncStreams(Streams):
    """The CPU: the host is the device."""


class CudaStreams(Streams):
    """A CUDA device's streams, events, pinned memory and graphs (torch.cuda's objects themselves)."""

    asynchronous = True
    records_graphs = True

    def __init__(self, device: torch.device, wait_seconds: float = WAIT_SECONDS):
        super().__init__(wait_seconds)
        self.device = device

    def stream(self):
        return torch.cuda.Stream(device=self.device)

    def event(self):
        return torch.cuda.Event()

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def launch(self, stream, work: Callable[[], object]) -> object:
        with torch.cuda.stream(stream):
            return work()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def pinned_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def pin(self, address: int, nbytes: int) -> bool:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)) == 0

    def unpin(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def capture(self, run: Callable[[], torch.Tensor]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph, out


SYNC = SyncStreams()


def streams_for(device: torch.device) -> Streams:
    """The streams of a device: CUDA's own on a CUDA device, the synchronous ones elsewhere."""
    return CudaStreams(device) if device.type == "cuda" else SYNC


class StandinStream:
    """A stand-in stream: work queued in order, `ran` of the `queued` items run; `held`: a test holds it back;
    `busy`: the thread running one of its items."""

    def __init__(self, owner: "StandinStreams", name: str):
        self.owner, self.name = owner, name
        self.work: collections.deque = collections.deque()
        self.queued = self.ran = 0
        self.held = False
        self.busy: int | None = None

    def wait_event(self, event: "StandinEvent") -> None:
        self.owner.stream_waits(self, event)

    def wait_stream(self, other: "StandinStream") -> None:
        event = self.owner.event()
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        self.owner.host_sync(f"stream {self.name}.synchronize()")
        self.owner.run_until(self, self.queued, f"stream {self.name}.synchronize()")

    def __repr__(self) -> str:
        return f"<stand-in stream {self.name}: {self.ran}/{self.queued} run{', held' if self.held else ''}>"


class StandinEvent:
    """A stand-in event: complete once its stream has run `target` items (set when recorded)."""

    def __init__(self, owner: "StandinStreams"):
        self.owner = owner
        self.stream: StandinStream | None = None
        self.target = 0

    def record(self, stream: StandinStream | None = None) -> None:
        self.owner.record(self, stream)

    def query(self) -> bool:
        self.owner.host_sync("event.query()", waits=False)
        return self.owner.done(self, "event.query()")

    def synchronize(self) -> None:
        self.owner.host_sync("event.synchronize()")
        self.owner.complete(self, "event.synchronize()")


class StandinGraph:
    """The stand-in's recorded pass: replay() runs the pass again, under the recording's rules, into the
    same output tensor."""

    def __init__(self, owner: "StandinStreams", run: Callable[[], torch.Tensor]):
        self.owner, self.run = owner, run
        self.out: torch.Tensor | None = None
        self.replays = 0

    def record(self) -> torch.Tensor:
        with self.owner.recording():
            self.out = self.run()
        return self.out

    def replay(self) -> None:
        with self.owner.recording():
            self.out.copy_(self.run())
        self.replays += 1


class StandinStreams(Streams):
    """CUDA's orchestration on CPU tensors (the module's docstring). Counts what tests assert on: launches
    (work queued on a side stream), pinned (address -> bytes pinned now), recorded (record_stream calls as
    (data pointer, stream name)), graphs (passes recorded)."""

    asynchronous = True
    records_graphs = True
    kernels_of = "cuda"  # CUDA's backend (its Triton gather runs on CPU tensors in Triton's interpreter)

    def __init__(self, wait_seconds: float = STANDIN_WAIT_SECONDS):
        super().__init__(wait_seconds)
        self.lock = threading.Condition(threading.RLock())
        self.compute = StandinStream(self, "compute")
        self.side: list[StandinStream] = []
        self.running = threading.local()  # .stream: the stream whose work this thread runs now
        self.capturing = 0
        self.launches = self.graphs = 0
        self.pinned: dict[int, int] = {}
        self.buffers: dict[int, int] = {}  # pinned_zeros' buffers alive: address -> bytes (host memory, as pinned)
        self.recorded: list[tuple[int, str]] = []
        self.sync_observer: Callable[[str], None] | None = None  # told of each host wait (engine.backends.costs)

    def stream(self) -> StandinStream:
        with self.lock:
            self.side.append(StandinStream(self, f"side{len(self.side)}"))
            return self.side[-1]

    def event(self) -> StandinEvent:
        return StandinEvent(self)

    def current_stream(self) -> StandinStream:
        return getattr(self.running, "stream", None) or self.compute

    def synchronous(self, stream: StandinStream) -> bool:
        """Whether work on `stream` runs at once: the compute stream, or the stream whose work runs now."""
        return stream is self.compute or stream is self.current_stream()

    def launch(self, stream: StandinStream, work: Callable[[], object]) -> object:
        if self.synchronous(stream):
            return work()
        with self.lock:
            stream.work.append(work)
            stream.queued += 1
            self.launches += 1
        return True

    def record(self, event: StandinEvent, stream: StandinStream | None) -> None:
        stream = stream or self.current_stream()
        with self.lock:
            event.stream = stream
            event.target = stream.ran if self.synchronous(stream) else stream.queued

    def done(self, event: StandinEvent, what: str) -> bool:
        if event.stream is None:
            raise RuntimeError(f"{what}: the event was never recorded")
        return event.stream.ran >= event.target

    def complete(self, event: StandinEvent, what: str) -> None:
        """Block the host until the event completes (running its stream's work up to it)."""
        self.done(event, what)
        self.run_until(event.stream, event.target, what)

    def stream_waits(self, stream: StandinStream, event: StandinEvent) -> None:
        """stream.wait_event(event): at once where the stream is synchronous, else as the stream's next work."""
        what = f"stream {stream.name} waiting on an event of stream {event.stream.name if event.stream else '?'}"
        self.done(event, what)
        if self.synchronous(stream):
            self.run_until(event.stream, event.target, what)
            return
        on, target = event.stream, event.target
        self.launch(stream, lambda: self.run_until(on, target, what))

    def run_until(self, stream: StandinStream, target: int, what: str) -> None:
        """Run the stream's queued work until `target` items have run, in order; wait (bounded) while it is
        held back or another thread runs its work."""
        me = threading.get_ident()
        deadline = time.monotonic() + self.wait_seconds
        with self.lock:
            if stream.busy == me and target > stream.ran:
                raise RuntimeError(f"{what}: stream {stream.name} waits for its own later work "
                                   "(a deadlock on a device)")
            while stream.ran < target or stream.busy not in (None, me):
                if stream.held or stream.busy not in (None, me):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(f"{what}: stream {stream.name} did not run for {self.wait_seconds:g} s "
                                           f"({'held back' if stream.held else 'busy on another thread'})")
                    self.lock.wait(left)
                    continue
                self._run_next(stream, me, what)

    def _run_next(self, stream: StandinStream, me: int, what: str) -> None:
        """Run the stream's next item on this thread, the stream current (synchronous) while it runs."""
        work = stream.work.popleft()
        stream.ran += 1
        stream.busy, previous = me, getattr(self.running, "stream", None)
        self.running.stream = stream
        try:
            if work() is False:
                raise RuntimeError(f"{what}: work queued on stream {stream.name} did not run (it returned False)")
        finally:
            self.running.stream, stream.busy = previous, None
            self.lock.notify_all()

    @contextlib.contextmanager
    def hold(self, stream: StandinStream):
        """Hold the stream's work back (waits on it block, bounded) until the block ends or release()."""
        stream.held = True
        try:
            yield stream
        finally:
            self.release(stream)

    def release(self, stream: StandinStream) -> None:
        with self.lock:
            stream.held = False
            self.lock.notify_all()

    def host_sync(self, what: str, waits: bool = True) -> None:
        """A host wait on the device (waits: the host blocks, as an event's query does not): refused while a
        pass is recorded (a graph cannot hold one); told to sync_observer."""
        if self.capturing:
            raise RuntimeError(f"{what} inside a recorded pass: a graph cannot wait on the host")
        if waits and self.sync_observer is not None:
            self.sync_observer(what)

    def pinned_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        self.buffers[t.data_ptr()] = t.numel() * t.element_size()
        weakref.finalize(t, self.buffers.pop, t.data_ptr(), None)
        return t

    def synchronize(self) -> None:
        self.host_sync("synchronize()")
        for stream in list(self.side):
            self.run_until(stream, stream.queued, "synchronize()")

    def pin(self, address: int, nbytes: int) -> bool:
        with self.lock:
            if address in self.pinned:
                return False  # (as cudaHostRegister: memory is pinned once)
            self.pinned[address] = nbytes
        return True

    def unpin(self, address: int) -> None:
        with self.lock:
            self.pinned.pop(address, None)

    def record_stream(self, tensor: torch.Tensor, stream: StandinStream) -> None:
        self.recorded.append((tensor.data_ptr(), stream.name))

    def capture(self, run: Callable[[], torch.Tensor]):
        graph = StandinGraph(self, run)
        out = graph.record()
        self.graphs += 1
        return graph, out

    @contextlib.contextmanager
    def recording(self):
        """A recorded pass: no host sync inside; at its end no work it queued left on another stream (a CUDA
        graph's forked streams must be joined back into the recording one)."""
        before = {s: s.queued for s in self.side}
        self.capturing += 1
        try:
            with RefuseHostReads():
                yield
        finally:
            self.capturing -= 1
        left = [s.name for s in self.side if s.queued > before.get(s, 0) and s.ran < s.queued]
        if left:
            raise RuntimeError(f"a recorded pass ended with work left on stream(s) {', '.join(left)}: "
                               "the recording stream never waited for it")
