"""The host<->device transfer resources of a cache, shared by its layers (Transfer); each layer's exact host store
and the prefetch of its fetched rows are engine/kvcache/host_store.py's (HostStore).

On the CPU the store and the "device" are the same memory and every call is a plain copy.

On a device with memory of its own and asynchronous streams (CUDA; engine.backends.streams, whose
stand-in runs this code on CPU tensors in the tests) the store lives in host memory pinned in place at
exactly its bytes (Transfer.pin_host, once the cache is built; mapped into the device's address space). A prefetch
must not stall the GPU: a Triton kernel on a side stream reads the selected rows straight from the
pinned store into the device's fetched set (its backend's Kernels.gather_rows: on CUDA
engine.backends.triton_guide.gather_rows), recording a
`ready` event. Without Triton (or after a launch error) the fallback is a worker thread: the indices
are copied to pinned host memory asynchronously (an event marks when they are there), the thread
gathers the rows on the CPU into a pinned staging buffer and issues the copy on the side stream. The
next step's attention makes the compute stream wait for `ready`, so the fetch overlaps everything the
GPU does in between (the rest of this step, and the layers before this one in the next).
`overlap_share()` reports how often the fetch had finished before the attention needed it. The host
memory itself is engine/backends/host_mapping.py's; the worker thread and the row gathers are in
engine/kvcache/host_memory.py.

Exact mode's verification (engine/kvcache/policies/exact.py) attends with every committed exact K/V. On
CUDA a `VerifyStream` copies them layer by layer from the pinned store into two device buffers on
the side stream, so that the copies of the next layers run while this one computes; on the CPU the
store is read in place (the stream can be forced there for tests: Transfer(stream_verify=True)).
"""
from __future__ import annotations

import torch

from engine.backends.host_mapping import HostMapping, mapped_zeros
from engine.backends.host_pages import PlacedPages
from engine.backends.kernels import backend_for
from engine.backends.streams import Streams, streams_for
from engine.errors import DoesNotFit
from engine.kvcache.host_memory import PrefetchWorker
from engine.kvcache.verify_stream import VerifyStream
from engine.machine import pinnable_bytes

GIB = 2**30


class Transfer:
    """The transfer resources of one cache, shared by its layers: on an asynchronous device (CUDA) one side
    stream and one worker thread (started on the first prefetch); nothing on the CPU. `close()` ends the
    thread. streams: the device's (engine.backends.streams; default streams_for(device); tests pass the
    stand-in on the CPU to run CUDA's orchestration there).
    stream_verify: exact mode's verification copies the store through VerifyStream's two device
    buffers (default: on CUDA; True on the CPU only in tests, where the copies are plain copies).
    residual_in_store: a guided layer's residual window is its host store's positions (default: where
    the store is the device's memory, the CPU); False on the CPU only in tests, to run the CUDA layout's
    own residual buffers there."""

    def __init__(self, device: torch.device, threaded: bool | None = None, stream_verify: bool | None = None,
                 residual_in_store: bool | None = None, streams: Streams | None = None):
        self.device = device
        self.streams = streams or streams_for(device)
        self.asynchronous = self.streams.asynchronous
        self.threaded = self.asynchronous if threaded is None else threaded
        self.stream_verify = self.asynchronous if stream_verify is None else stream_verify
        # the store is the device's memory: the CPU's own (a meta device, for shapes, is laid out as a GPU's)
        shared = device.type == "cpu" and not self.asynchronous
        self.residual_in_store = shared if residual_in_store is None else residual_in_store and shared
        self.stream = self.streams.stream() if self.asynchronous else None
        self._worker: PrefetchWorker | None = None
        self.verify: VerifyStream | None = None  # exact mode's, made by its first layer (verify_stream)
        self.host_tensors: list[torch.Tensor] = []  # the exact host store's tensors (host_tensor), all layers
        self._mappings: list[HostMapping] = []  # their memory
        self._registered: list[HostMapping] = []  # CUDA: those pinned by pin_host(), unpinned by close()
        self.placed = PlacedPages()  # stored rows mapped into the store from their entries (HostStore.place_row)

    def host_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero host tensor of the exact store, exactly its bytes (untouched_zeros: an anonymous mapping,
        resident only where written). On CUDA pin_host() pins them all at once, after the cache is built:
        torch's pinned caching allocator would round every block up to a power of two (22 rows of 32k
        tokens: 2 GiB asked, 4 GiB taken, per layer and K/V)."""
        t, mapping = mapped_zeros(shape, dtype)
        self.host_tensors.append(t)
        if mapping is not None:
            self._mappings.append(mapping)
        return t

    @property
    def kernels(self):
        """The device's backend (engine.backends.kernels; the stand-in's: CUDA's), for its gather from the store."""
        return backend_for(self.streams.kernels_of or self.device)

    @property
    def pinned(self) -> bool:
        """Whether the store is pinned (mapped: kernels may read it in place)."""
        return bool(self._registered)

    def host_bytes_allocated(self) -> int:
        """Bytes of the exact store's host tensors (what the planner counts as host bytes)."""
        return sum(t.numel() * t.element_size() for t in self.host_tensors)

    def pin_host(self, available: int | None = None) -> None:
        """CUDA: page-lock the store's host tensors in place (cudaHostRegister, mapped: copies from them run
        asynchronously and a kernel may read them), after checking that they fit in the RAM that may be
        pinned (engine.machine.pinnable_bytes: what is available less the planner's reserve). Raises
        DoesNotFit, pinning nothing, when they do not. Nothing to do on the CPU."""
        if not self.asynchronous or not self.host_tensors:
            return
        need = self.host_bytes_allocated()
        room = pinnable_bytes() if available is None else available
        if need > room:
            raise DoesNotFit(f"the exact host store needs {need / GIB:.1f} GiB of pinned RAM and "
                             f"{max(room, 0) / GIB:.1f} GiB can be pinned now (RAM available less a "
                             "reserve): lower --batch or the context")
        for mapping in self._mappings:
            if not mapping.pin(self.streams):
                self.unpin_host()
                raise DoesNotFit(f"pinning {mapping.nbytes / GIB:.1f} GiB of the exact host store failed: lower "
                                 "--batch or the context")
            self._registered.append(mapping)

    def unpin_host(self) -> None:
        """Undo pin_host (the tensors stay valid, as pageable memory)."""
        if self._registered:
            self.streams.synchronize()  # no copy from or to them is in flight
            for mapping in self._registered:
                mapping.unpin()
            self._registered = []

    def verify_stream(self) -> "VerifyStream":
        """The cache's one VerifyStream (exact mode), made on the first call."""
        if self.verify is None:
            self.verify = VerifyStream(self)
        return self.verify

    def verify_bytes_per_row(self) -> int:
        """Device bytes per row of the verification buffers (allocated on the first verification)."""
        return self.verify.bytes_per_row() if self.verify is not None else 0

    def submit(self, job) -> None:
        """Run job() on the worker thread (in order), or at once without one."""
        if not self.threaded:
            job()
            return
        if self._worker is None:
            self._worker = PrefetchWorker()
        self._worker.submit(job)

    def close(self) -> None:
        """Finish queued jobs, end the worker thread and unpin the store (idempotent)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self.unpin_host()

    def host_ready(self) -> None:
        """CUDA: wait for the copies queued into the pinned store (HostStore.write_span is asynchronous)
        before the CPU reads it (a document-store export, a row copy, the hit-rate count)."""
        if self.asynchronous:
            self.streams.current_stream().synchronize()
