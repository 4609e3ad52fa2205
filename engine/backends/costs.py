"""What a stretch of the engine asks of a GPU, counted on the CPU without one: kernel launches, bytes moved
in device memory, bytes over PCIe and host syncs, from the ops torch dispatches while a CostCounter is active
(a TorchDispatchMode and a TorchFunctionMode on the counting thread; nothing is counted, and nothing costs,
outside one). The CUDA orchestration runs on CPU tensors through the stand-in (engine.backends.streams.
StandinStreams), which knows which memory is the host's: the exact store pinned in place and its pinned
buffers (host_memory). engine/plan/step_costs.py gives the planner the counts per decode step and
mode; tests/test_cost_model.py counts them and holds them to budgets.

What counts:
  launch         a dispatched op that computes or copies (a view, a reshape or an allocation launches
                 nothing: NO_LAUNCH); an op whose tensors all lie in host memory is the host's work, not a
                 launch (the worker thread's gather runs on a thread of its own and is not seen at all)
  device bytes   per launch, the bytes of its tensor arguments and of the outputs it writes (each tensor
                 once; a gather or an index reads only the rows it takes: its output's bytes); host tensors
                 an op reads or writes count over PCIe instead
  PCIe bytes     a copy between host and device memory (copy_, to), or a kernel reading mapped host memory
                 in place (a gather from the pinned store: the rows taken)
  host syncs     a tensor's value read on the host (tolist, item, bool, int, float, an index) and a host wait
                 on the device (a stream's or event's synchronize, the device's); an event's query waits for
                 nothing and is not one"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__}  # a tensor's value read on the host
# ops that make views or allocate: no kernel on a GPU
NO_LAUNCH = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "reshape", "slice", "select",
    "unsqueeze", "squeeze", "expand", "transpose", "t", "as_strided", "alias", "permute", "detach", "split",
    "unbind", "narrow", "lift_fresh", "_reshape_alias", "view_as", "expand_as", "_to_copy_noop", "unfold",
    "split_with_sizes", "chunk", "diagonal", "view_as_real", "view_as_complex", "_local_scalar_dense",
    "is_nonzero", "set_", "resize_", "clone_noop"})
# ops that return their input itself where nothing needs converting (no kernel then)
IDENTITY = frozenset({"to", "contiguous", "type_as", "resolve_conj", "resolve_neg"})
# ops that read only the rows they take from their first argument (its bytes are the output's)
GATHERS = frozenset({"index_select", "gather", "index", "take_along_dim", "embedding"})


@dataclass
class Counts:
    """What a counted stretch asked of the device: launches (kernels and device copies), bytes read and written
    in device memory, bytes over PCIe (both ways), host syncs, and the launches by op name."""

    launches: int = 0
    device_bytes: int = 0
    pcie_bytes: int = 0
    host_syncs: int = 0
    ops: Counter = field(default_factory=Counter)
    pcie: Counter = field(default_factory=Counter)  # PCIe bytes by op name
    syncs: list[str] = field(default_factory=list)  # what each host sync was


def nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements take (a view's own, not its storage's)."""
    return t.numel() * t.element_size()


def tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (lists and tuples of them included)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors(item)]
    if isinstance(tree, dict):
        return tensors(list(tree.values()))
    return []


def aliases(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """Whether an op only returned its input, or a view of it (no kernel): a conversion with nothing to convert
    (IDENTITY) returns the tensor itself; a view is a new tensor on an input's memory (an in-place op, named
    with a trailing underscore, or one given `out=` returns the very tensor it wrote)."""
    if not outputs or not inputs:
        return False
    first = outputs[0]
    if any(first is t for t in inputs):
        return name in IDENTITY
    return not name.endswith("_") and any(first.data_ptr() == t.data_ptr() and first.numel() for t in inputs)


class RefuseHostReads(torch.overrides.TorchFunctionMode):
    """A tensor's value read on the host (tolist, item, bool, int, float, an index): on a device a host
    sync, which a recorded pass cannot hold; on the stand-in's CPU tensors free, so refused here
    (StandinStreams.recording)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise RuntimeError(f"Tensor.{func.__name__} inside a recorded pass: a graph cannot read a value on the host")
        return func(*args, **(kwargs or {}))


def host_memory(streams) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor lies in host memory, by what the stand-in's streams know (the exact store pinned in
    place: `pinned`, and the pinned buffers alive: `buffers`); with other streams, none does."""
    spans = [getattr(streams, name, {}) for name in ("pinned", "buffers")]

    def is_host(tensor: torch.Tensor) -> bool:
        address = tensor.data_ptr()
        return any(start <= address < start + size for memory in spans for start, size in list(memory.items()))
    return is_host


class _HostReads(torch.overrides.TorchFunctionMode):
    """The tensor values read on the host while its counter is active."""

    def __init__(self, counter: "CostCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.counter.sync(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class CostCounter(TorchDispatchMode):
    """Counts (Counts) what the ops dispatched on this thread ask of a device, while active (`with counter:`).
    streams: the device's (the stand-in's: it says which memory is the host's and reports its host waits; other
    streams: all memory is the device's and only value reads count as host syncs)."""

    def __init__(self, streams=None):
        super().__init__()
        self.streams = streams
        self.is_host = host_memory(streams)
        self.counts = Counts()
        self._reads = _HostReads(self)
        self._thread = 0
        self._paused = 0

    def __enter__(self):
        self._thread = threading.get_ident()
        if hasattr(self.streams, "sync_observer"):
            self.streams.sync_observer = self.host_wait
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)
            if hasattr(self.streams, "sync_observer"):
                self.streams.sync_observer = None

    def host_wait(self, what: str) -> None:
        """The stand-in's host wait on the device: a sync where the counting thread waits (a worker thread's
        wait holds up no step)."""
        if threading.get_ident() == self._thread:
            self.sync(what)

    def sync(self, what: str) -> None:
        if self._paused:
            return
        self.counts.host_syncs += 1
        self.counts.syncs.append(what)

    def take(self) -> Counts:
        """The counts so far; the counter starts again from zero."""
        counts, self.counts = self.counts, Counts()
        return counts

    @contextlib.contextmanager
    def paused(self):
        """Nothing counted inside (a kernel counted whole by kernel(), whose stand-in runs torch ops)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def kernel(self, name: str, args: tuple) -> None:
        """A kernel launched outside torch's dispatch (a Triton kernel): one launch, its tensor arguments' bytes
        (each read or written once: an upper bound where it reads a part of one)."""
        unique = list({id(t): t for t in tensors(list(args))}.values())
        self.count(name, unique, [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and not self._paused:
            inputs, outputs = tensors(args) + tensors(kwargs or {}), tensors(out)
            if not aliases(name, inputs, outputs):
                self.count(name, inputs, outputs)
        return out

    def count(self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """One dispatched op: a launch with its bytes, or the host's own work."""
        seen = {id(t) for t in inputs}
        touched = inputs + [t for t in outputs if id(t) not in seen]
        host = [self.is_host(t) for t in touched]
        if touched and all(host):
            return  # the host's work (a gather into a host buffer)
        out_bytes = sum(nbytes(t) for t in outputs)
        device = pcie = 0
        for i, (t, on_host) in enumerate(zip(touched, host)):
            size = min(nbytes(t), out_bytes) if i == 0 and name in GATHERS else nbytes(t)
            if on_host:
                pcie += size
            else:
                device += size
        c = self.counts
        c.launches += 1
        c.device_bytes += device
        c.pcie_bytes += pcie
        c.ops[name] += 1
        if pcie:
            c.pcie[name] += pcie
