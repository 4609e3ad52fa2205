"""All host<->device transfer code: the exact host store and the prefetch of fetched rows.

On the CPU the store and the "device" are the same memory and every call is a plain copy.

On a CUDA device the store lives in pinned host memory. A prefetch must not stall the GPU:
the selected indices are copied to pinned host memory asynchronously (an event marks when
they are there); a worker thread waits for that event, gathers the rows on the CPU into a
pinned staging buffer, and issues the host-to-device copy on a side stream, recording a
`ready` event. The next step's attention makes the compute stream wait for `ready`, so the
copy overlaps everything the GPU does in between (the rest of this step, and the layers
before this one in the next). `overlap_share()` reports how often the copy had finished
before the attention needed it.
"""
from __future__ import annotations

import queue
import threading

import torch


class Transfer:
    """The transfer resources of one cache, shared by its layers: on CUDA one side stream and one
    worker thread (started on the first prefetch); nothing on the CPU. `close()` ends the thread."""

    def __init__(self, device: torch.device, threaded: bool | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.threaded = self.cuda if threaded is None else threaded
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._worker: PrefetchWorker | None = None

    def submit(self, job) -> None:
        """Run job() on the worker thread (in order), or at once without one."""
        if not self.threaded:
            job()
            return
        if self._worker is None:
            self._worker = PrefetchWorker()
        self._worker.submit(job)

    def close(self) -> None:
        """Finish queued jobs and end the worker thread (idempotent)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None


class HostStore:
    """Exact K/V of every token of every row of one layer: [B, H_kv, L, D] each, preallocated."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, k_max: int,
                 dtype: torch.dtype, device: torch.device, transfer: Transfer):
        self.device = device
        self.cuda = device.type == "cuda"
        self.transfer = transfer
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)  # [B, H_kv, L, D] host
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)
        fshape = (batch, kv_heads, max(k_max, 1), head_dim)
        # the fetched set on the device: exact K/V of the selected positions, [B, H_kv, k, D]
        self.fk = torch.zeros(fshape, dtype=dtype, device=device)
        self.fv = torch.zeros(fshape, dtype=dtype, device=device)
        self.waits = self.ready_in_time = 0  # CUDA: fetches needed / already complete when needed
        if self.cuda:
            self.stage_k = torch.zeros(fshape, dtype=dtype, pin_memory=True)
            self.stage_v = torch.zeros(fshape, dtype=dtype, pin_memory=True)
            self.idx_host = torch.zeros(fshape[:3], dtype=torch.long, pin_memory=True)
            self.idx_ready = torch.cuda.Event()
            self.ready = torch.cuda.Event()
            self.issued = threading.Event()  # set by the worker once `ready` is recorded
        self.pending = False

    def write_span(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one row's new tokens at positions [start, start + T): k/v [H_kv, T, D] (device) -> host."""
        end = start + k.shape[1]
        self.k[row, :, start:end] = k.to("cpu") if self.cuda else k
        self.v[row, :, start:end] = v.to("cpu") if self.cuda else v

    def read(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V of one row's positions [start, end) on the compute device. -> [1, H_kv, n, D] each."""
        k, v = self.k[row : row + 1, :, start:end], self.v[row : row + 1, :, start:end]
        if self.cuda:
            return k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
        return k, v

    def prefetch(self, rows: slice, idx: torch.Tensor) -> None:
        """Start fetching the exact K/V at idx [b, H_kv, k] (positions) into the device fetched set."""
        n = idx.shape[-1]
        if not self.cuda:
            gather_rows(self.k[rows], idx, self.fk[rows, :, :n])
            gather_rows(self.v[rows], idx, self.fv[rows, :, :n])
            return
        self.wait_issued()  # the previous prefetch of this layer is issued (its buffers are ours again)
        self.idx_host[rows, :, :n].copy_(idx, non_blocking=True)
        self.idx_ready.record()
        self.issued.clear()
        self.pending = True
        self.transfer.submit(lambda: self._gather_and_copy(rows, n))

    def _gather_and_copy(self, rows: slice, n: int) -> None:
        """Worker thread: gather the selected rows on the CPU, copy them to the device on the side stream."""
        try:
            self.idx_ready.synchronize()
            idx = self.idx_host[rows, :, :n]
            gather_rows(self.k[rows], idx, self.stage_k[rows, :, :n])
            gather_rows(self.v[rows], idx, self.stage_v[rows, :, :n])
            with torch.cuda.stream(self.transfer.stream):
                self.fk[rows, :, :n].copy_(self.stage_k[rows, :, :n], non_blocking=True)
                self.fv[rows, :, :n].copy_(self.stage_v[rows, :, :n], non_blocking=True)
                self.ready.record(self.transfer.stream)
        finally:
            self.issued.set()

    def wait_issued(self) -> None:
        if self.cuda and self.pending:
            self.issued.wait()

    def fetched(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched set for rows, after making the compute stream wait for the prefetch."""
        if self.pending:
            self.wait_issued()
            self.waits += 1
            self.ready_in_time += int(self.ready.query())
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.pending = False
        return self.fk[rows], self.fv[rows]

    def host_bytes(self, tokens: int) -> int:
        """Bytes of exact K and V held for `tokens` tokens of this layer."""
        return 2 * tokens * self.k.shape[1] * self.k.shape[3] * self.k.element_size()


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h, j] = src[b, h, idx[b, h, j]]: whole D-vectors, copied as rows (index_select) rather
    than element by element (gather). src [b, H_kv, L, D], idx [b, H_kv, k], out [b, H_kv, k, D]."""
    b, h, length, d = src.shape
    base = torch.arange(b * h, device=idx.device).view(b, h, 1) * length
    flat = (idx + base).reshape(-1)
    if src.is_contiguous() and out.is_contiguous():
        torch.index_select(src.view(-1, d), 0, flat, out=out.view(-1, d))
    else:
        out.copy_(src.reshape(-1, d).index_select(0, flat).view(out.shape))


class PrefetchWorker:
    """One daemon thread running prefetch jobs in order (torch ops release the GIL); close() ends it."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="specache-prefetch", daemon=True)
        self.thread.start()

    def submit(self, job) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


def overlap_share(stores: list[HostStore]) -> float | None:
    """Share of fetches whose copy had completed before the attention needed it (CUDA only)."""
    waits = sum(s.waits for s in stores)
    return sum(s.ready_in_time for s in stores) / waits if waits else None
