"""All host<->device transfer code: the exact host store and the prefetch of fetched rows.

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

import threading

import torch

from engine.backends.host_mapping import HostMapping, mapped_zeros, untouched_zeros
from engine.backends.host_pages import MappedFile, PlacedPages, paged_length
from engine.backends.kernels import backend_for
from engine.backends.streams import Streams, streams_for
from engine.errors import DoesNotFit
from engine.kvcache.host_memory import PrefetchWorker, corrected_rows, corrected_rows_fixed, gather_rows
from engine.kvcache.verify_stream import WHOLE_ROWS_WASTE, VerifyStream, copy_prefix
from engine.machine import pinnable_bytes

__all__ = ["Transfer", "HostStore", "VerifyStream", "overlap_share", "copy_prefix", "corrected_rows",
           "corrected_rows_fixed", "untouched_zeros", "WHOLE_ROWS_WASTE"]

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


class HeldRow:
    """One row's exact K/V on the device while it is prefilled (HostStore.read_prefix): k, v [1, H_kv, L, D],
    positions [0, upto) of `row` filled."""

    def __init__(self, k: torch.Tensor):
        self.k, self.v = k, torch.empty_like(k)
        self.row, self.upto = -1, 0


class HostStore:
    """Exact K/V of every token of every row of one layer: [B, H_kv, L, D] each, preallocated. dtype: the
    elements of the store and of the fetched set, or (the store's, the fetched set's) where they differ (a
    16-bit store on the CPU: rows are widened to the compute dtype as they are fetched)."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, k_max: int,
                 dtype: torch.dtype | tuple[torch.dtype, torch.dtype], device: torch.device, transfer: Transfer):
        self.device = device
        self.transfer, self.streams = transfer, transfer.streams
        self.held: HeldRow | None = None  # CUDA: the prefilling row's exact K/V on the device (read_prefix)
        self.asynchronous = transfer.asynchronous  # (CUDA's orchestration: streams, events, a pinned store)
        kept, dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
        # read in place (the CPU): each row's KV heads start on a page, for place_row (never touched past max_len)
        in_place = not self.asynchronous and not transfer.stream_verify
        shape = (batch, kv_heads, paged_length(max_len, head_dim * kept.itemsize) if in_place else max_len, head_dim)
        self.k = transfer.host_tensor(shape, kept)  # [B, H_kv, L, D] host (pinned on CUDA: Transfer.pin_host)
        self.v = transfer.host_tensor(shape, kept)
        fshape = (batch, kv_heads, max(k_max, 1), head_dim)
        # the fetched set on the device: exact K/V of the selected positions, [B, H_kv, k, D] (on the CPU
        # the fused decode of prefetch "current" reads the store in place and never touches it)
        fetched = (lambda: untouched_zeros(fshape, dtype)) if device.type == "cpu" else \
            (lambda: torch.zeros(fshape, dtype=dtype, device=device))
        self.fk, self.fv = fetched(), fetched()
        self.waits = self.ready_in_time = 0  # asynchronous: fetches needed / already complete when needed
        self.in_place = 0  # asynchronous: fetches gathered by the kernel from the pinned store (_gather_in_place)
        if self.asynchronous:
            streams = self.streams
            self.stage_k = streams.pinned_zeros(fshape, dtype)
            self.stage_v = streams.pinned_zeros(fshape, dtype)
            self.idx_host = streams.pinned_zeros(fshape[:3], torch.long)
            self.idx_ready = streams.event()
            self.ready = streams.event()
        # set while no worker job of this layer is outstanding: cleared when one is queued, set by the job once
        # `ready` is recorded (the in-place gather records `ready` itself: it leaves it set)
        self.issued = threading.Event()
        self.issued.set()
        self.pending = False

    def write_span(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one row's new tokens at positions [start, start + T): k/v [H_kv, T, D] (device) -> host.
        On CUDA one asynchronous copy per KV head into the pinned store (each head's span is contiguous
        there; a strided copy would go through a pageable temporary, synchronously): readers on the CPU
        wait for them first (Transfer.host_ready)."""
        end = start + k.shape[1]
        if not self.asynchronous:
            self.k[row, :, start:end] = k
            self.v[row, :, start:end] = v
            return
        for h in range(k.shape[0]):
            self.k[row, h, start:end].copy_(k[h], non_blocking=True)
            self.v[row, h, start:end].copy_(v[h], non_blocking=True)
        held = self.hold(row) if start == 0 else self.held  # (a row's first tokens: its prefill begins)
        if held is not None and held.row == row and start <= held.upto:  # (the prefilling row: kept on the device)
            held.k[0, :, start:end], held.v[0, :, start:end] = k, v
            held.upto = max(held.upto, end)

    def place_row(self, row: int, k: torch.Tensor, v: torch.Tensor, pages: MappedFile) -> bool:
        """Row's first positions hold the stored rows k/v [H_kv, n, D] of a mapped entry (pages), its pages mapped
        over them copy-on-write, not copied. The CPU only (a pinned store's pages stay its own). -> whether it did."""
        return not self.asynchronous and pages.place(k, self.k[row], self.transfer.placed) \
            and pages.place(v, self.v[row], self.transfer.placed)

    def read_prefix(self, row: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V of row's positions [0, end) on the compute device, for a chunk of its prefill. -> [1, H_kv, n,
        D] each. CUDA: the prefilling row's exact K/V stay on the device while its prefill needs them (HeldRow,
        filled by write_span as positions enter the store; read over the bus only where it did not see them, a
        stored document prefix): each position crosses the bus at most once per prefill, not once a chunk."""
        if not self.asynchronous:
            return self.read(row, 0, end)
        held = self.hold(row)
        if held.upto < end:
            held.k[:, :, held.upto : end], held.v[:, :, held.upto : end] = self.read(row, held.upto, end)
            held.upto = end
        return held.k[:, :, :end], held.v[:, :, :end]

    def hold(self, row: int) -> "HeldRow":
        """The device copy of `row`'s exact K/V during its prefill (the buffers reused from row to row)."""
        held = self.held
        if held is None:
            held = self.held = HeldRow(torch.empty((1, *self.k.shape[1:]), dtype=self.k.dtype, device=self.device))
        if held.row != row:
            held.row, held.upto = row, 0
        return held

    def release_prefix(self) -> None:
        """The prefill is over (the first decode pass): the held row's device memory goes back."""
        self.held = None

    def read(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V of one row's positions [start, end) on the compute device. -> [1, H_kv, n, D] each
        (CUDA: one asynchronous copy per KV head from the pinned store, as write_span)."""
        k, v = self.k[row : row + 1, :, start:end], self.v[row : row + 1, :, start:end]
        if not self.asynchronous:  # (the store's own elements: a 16-bit store's are widened by the reader)
            return k, v
        out_k = torch.empty(k.shape, dtype=k.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        for h in range(k.shape[1]):
            out_k[0, h].copy_(k[0, h], non_blocking=True)
            out_v[0, h].copy_(v[0, h], non_blocking=True)
        return out_k, out_v

    def prefetch(self, rows: slice, idx: torch.Tensor, fixed: bool = False) -> None:
        """Start fetching the exact K/V at idx [b, H_kv, k] (positions) into the device fetched set (fixed: a
        recorded pass: the in-place gather on the side stream, which join() brings back into the pass)."""
        n = idx.shape[-1]
        if not self.asynchronous:
            gather_rows(self.k[rows], idx, self.fk[rows, :, :n])
            gather_rows(self.v[rows], idx, self.fv[rows, :, :n])
            return
        self.wait_issued()  # the previous prefetch of this layer is issued (its buffers are ours again)
        if self.transfer.pinned and self._gather_in_place(rows, idx, n, record=not fixed):
            return
        if fixed:
            raise RuntimeError("the in-place gather did not run: the pass cannot be fixed-shape (can_gather_now)")
        self.idx_host[rows, :, :n].copy_(idx, non_blocking=True)
        self.idx_ready.record()
        self.issued.clear()
        self.pending = True
        self.transfer.submit(lambda: self._gather_and_copy(rows, n))

    def can_gather_now(self) -> bool:
        """Whether gather_now runs here: on the CPU always; on an asynchronous device with the store pinned
        (mapped) and the Triton gather available (the store is read in place)."""
        return not self.asynchronous or (self.transfer.pinned and self.transfer.kernels.runs("gather_rows"))

    def gather_now(self, rows: slice, idx: torch.Tensor) -> None:
        """Fetch the exact K/V at idx [b, H_kv, k] into the fetched set on the compute stream, in order with
        the pass (a fixed-shape pass, which a CUDA graph records: no worker thread, no side stream)."""
        n = idx.shape[-1]
        if not self.asynchronous:
            gather_rows(self.k[rows], idx, self.fk[rows, :, :n])
            gather_rows(self.v[rows], idx, self.fv[rows, :, :n])
            return
        if not self.transfer.kernels.gather_rows(self.k[rows], self.v[rows], idx, self.fk[rows, :, :n],
                                                 self.fv[rows, :, :n]):
            raise RuntimeError("the in-place gather did not run: the pass cannot be fixed-shape (can_gather_now)")

    def join(self) -> None:
        """Make the compute stream wait for this layer's in-flight prefetch (the end of a recorded pass: a CUDA
        graph may not leave work on another stream; the next pass reads the set it brought)."""
        if self.asynchronous and self.pending:
            self.streams.current_stream().wait_event(self.ready)
            self.pending = False

    def _gather_in_place(self, rows: slice, idx: torch.Tensor, n: int, record: bool = True) -> bool:
        """With the store pinned (mapped): one kernel on the side stream reads the selected rows of the store
        where they lie, over the bus, into the fetched set (no worker thread, no CPU gather, no staging
        copy), after what the compute stream queued so far (idx, and the attention that read the set it
        replaces). -> False where the kernel does not run (the worker thread's path then)."""
        k, v, fk, fv = self.k[rows], self.v[rows], self.fk[rows, :, :n], self.fv[rows, :, :n]
        if not self.transfer.kernels.gather_applies(k, v, idx, fk, fv):
            return False
        side = self.transfer.stream
        self.idx_ready.record()
        side.wait_event(self.idx_ready)
        if not self.streams.launch(side, lambda: self.transfer.kernels.gather_rows(k, v, idx, fk, fv)):
            return False
        self.ready.record(side)
        if record:  # (not in a recorded pass: its idx is the graph's own memory)
            self.streams.record_stream(idx, side)
        self.pending = True
        self.in_place += 1
        return True

    def _gather_and_copy(self, rows: slice, n: int) -> None:
        """Worker thread: gather the selected rows on the CPU, copy them to the device on the side stream."""
        try:
            self.idx_ready.synchronize()
            idx = self.idx_host[rows, :, :n]
            gather_rows(self.k[rows], idx, self.stage_k[rows, :, :n])
            gather_rows(self.v[rows], idx, self.stage_v[rows, :, :n])
            fk, fv = self.fk[rows, :, :n], self.fv[rows, :, :n]
            sk, sv = self.stage_k[rows, :, :n], self.stage_v[rows, :, :n]
            self.streams.launch(self.transfer.stream, lambda: (fk.copy_(sk, non_blocking=True),
                                                               fv.copy_(sv, non_blocking=True)))
            self.ready.record(self.transfer.stream)
        finally:
            self.issued.set()

    def settle(self) -> None:
        """Make the compute stream wait for an in-flight prefetch, so that what follows on it (a row
        copy of the fetched set: KVCache.copy_row) reads the fetched K/V, not what they replace."""
        if self.asynchronous and self.pending:
            self.wait_issued()
            self.streams.current_stream().wait_event(self.ready)

    def wait_issued(self) -> None:
        """Wait (bounded) until the worker thread has issued this layer's prefetch (recorded `ready`)."""
        if self.asynchronous and self.pending:
            self.streams.wait_flag(self.issued, "a prefetch of the exact K/V was never issued")

    def fetched(self, rows: slice, fixed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched set for rows, after making the compute stream wait for the prefetch (fixed: in a
        recorded pass, where an event cannot be queried from the host)."""
        if self.pending:
            self.wait_issued()
            self.waits += 1
            self.ready_in_time += 0 if fixed else int(self.ready.query())
            self.streams.current_stream().wait_event(self.ready)
            self.pending = False
        return self.fk[rows], self.fv[rows]

    def correct(self, rows: slice, idx: torch.Tensor, old_idx: torch.Tensor, old_valid: torch.Tensor,
                bound: int, fixed: bool = False) -> torch.Tensor:
        """Make the fetched set hold the exact K/V at idx [b, H_kv, k] now (a synchronous fetch), reusing the
        rows that the prefetch of old_idx (valid where old_valid) brought: only the missing positions cross
        from the host. bound: every position in idx and old_idx is below it; fixed: a recorded pass. A
        recorded pass and an asynchronous device take corrected_rows_fixed (no value read on the host: the
        compacted copy's count of missed rows would sync every layer); the CPU compacts (its read is free).
        -> reused [b, H_kv, k] bool: the slots the prefetch had already brought."""
        n = idx.shape[-1]
        fk, fv = self.fetched(rows, fixed)
        if fixed or self.asynchronous:
            k, v, reused = corrected_rows_fixed(fk[:, :, :n], fv[:, :, :n], self.k[rows], self.v[rows], idx, old_idx,
                                                old_valid, in_place=self.transfer.kernels.gather_rows
                                                if self.asynchronous and self.transfer.pinned else None)
        else:
            k, v, reused = corrected_rows(fk[:, :, :n], fv[:, :, :n], self.k[rows], self.v[rows], idx, old_idx,
                                          old_valid, bound)
        fk[:, :, :n], fv[:, :, :n] = k, v
        return reused

    def host_bytes(self, tokens: int) -> int:
        """Bytes of exact K and V held for `tokens` tokens of this layer."""
        return 2 * tokens * self.k.shape[1] * self.k.shape[3] * self.k.element_size()


def overlap_share(stores: list[HostStore]) -> float | None:
    """Share of fetches whose copy had completed before the attention needed it (asynchronous devices only)."""
    waits = sum(s.waits for s in stores)
    return sum(s.ready_in_time for s in stores) / waits if waits else None
