"""The exact host store of one guided layer (HostStore: every token's exact K/V, the fetched set and its
prefetch) and, on CUDA, the prefilling row's exact K/V held on the device (HeldRow). The transfer resources
a cache's layers share (streams, the worker thread, the pinned memory) are engine/kvcache/transfer.py's; see
its docstring for how a prefetch overlaps the compute on CUDA. On the CPU the store is the "device's" memory
and every call is a plain copy or a read in place; a stored document's rows are the pages of its entry
(place_row), released from this process's memory once its question's prefill has read them (unmap_read)."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from engine.backends.host_mapping import untouched_zeros
from engine.backends.host_pages import MappedFile, paged_length
from engine.kvcache.host_memory import corrected_rows, corrected_rows_fixed, gather_rows

if TYPE_CHECKING:
    from engine.kvcache.transfer import Transfer

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

    def unmap_read(self, row: int) -> None:
        """Row's rows placed from a stored entry (place_row), read by a prefill chunk, leave this process's memory
        (PlacedPages.release; read again from the page cache where a step fetches them): the question's prefill
        over a stored document holds one layer's rows at a time, not the whole store."""
        if self.transfer.placed.spans:
            self.transfer.placed.release(self.k[row])
            self.transfer.placed.release(self.v[row])

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
