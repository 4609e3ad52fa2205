"""Exact mode's verification stream: each layer's committed exact K/V copied from the pinned host store into
two device buffers, double-buffered on the cache's side stream (engine/kvcache/transfer.py makes one per
cache: Transfer.verify_stream)."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.backends.streams import Streams

WHOLE_ROWS_WASTE = 0.125  # verification copy: whole store rows in one copy when at most this share is unused


class TransferSide(Protocol):
    """What a VerifyStream reads of its cache's transfer resources (engine.kvcache.transfer.Transfer)."""

    asynchronous: bool
    stream_verify: bool
    device: torch.device
    streams: Streams
    stream: object  # the side stream (None where the device is synchronous)


class ExactStore(Protocol):
    """What a VerifyStream reads of a layer's exact host store (engine.kvcache.host_store.HostStore):
    its K and V, [B, H_kv, L, D] each."""

    k: torch.Tensor
    v: torch.Tensor


class VerifyStream:
    """Exact mode's verification on a device that does not hold the host store (CUDA): each layer's
    committed exact K/V, positions [0, past) of the pass's rows, is copied from the pinned store into
    one of two device buffers [B, H_kv, L, D] (K and V each, of the store's dtype; what the planner
    budgets as verify_buffers), double-buffered on the cache's side stream:

      begin(rows, past)  the copies of layers 0 and 1 (buffers 0 and 1), a `ready` event after each
      acquire(l)         the compute stream waits for layer l's `ready`; -> buffer l % 2 (the caller
                         writes the pass's new tokens into it and attends)
      release(l)         a `free` event on the compute stream after layer l's attention; the copy of
                         layer l + 2 into the same buffer is issued behind it on the side stream

    so two copies are always queued ahead of the attention that needs them, and layer l + 1's copy
    runs while layer l computes. A buffer is read only by the layer whose copy it holds in this pass
    (`holds`; anything else raises). A copy moves contiguous memory only (`copy_prefix`): a strided
    host-to-device copy would go through a pageable temporary, synchronously. On a synchronous device
    (tests: Transfer(stream_verify=True) on the CPU) the copies are plain copies and there are no events;
    the streams' stand-in (engine.backends.streams) runs the streamed path on the CPU.

    Counters: copied_bytes and passes (all verifications), waits / ready_in_time (asynchronous: layers
    attended / whose copy had completed by then)."""

    def __init__(self, transfer: TransferSide):
        self.transfer, self.streams = transfer, transfer.streams
        self.asynchronous = transfer.asynchronous
        self.stores: list[ExactStore] = []  # one per layer, in layer order
        self.k: torch.Tensor | None = None  # [2, B, H_kv, L, D] on the device, allocated on the first pass
        self.v: torch.Tensor | None = None
        self.holds: list[tuple[int, int] | None] = [None, None]  # (pass, layer) whose copy each buffer holds
        self.passes = 0
        self.rows, self.past = slice(0, 0), 0
        self.whole_rows_waste = WHOLE_ROWS_WASTE
        self.copied_bytes = 0
        self.waits = self.ready_in_time = 0
        if self.asynchronous:
            self.ready = [self.streams.event(), self.streams.event()]  # side stream: buffer i's copy is done
            self.free = [self.streams.event(), self.streams.event()]  # compute stream: buffer i's reader is done

    @property
    def staged(self) -> bool:
        """Whether verifications go through the buffers (else the store is read in place)."""
        return self.transfer.stream_verify

    def add(self, store: ExactStore) -> int:
        """Register the next layer's host store. -> its layer index."""
        self.stores.append(store)
        return len(self.stores) - 1

    def bytes_per_row(self) -> int:
        """Device bytes per row of the two K/V buffer pairs (0 when the store is read in place)."""
        if not self.staged or not self.stores:
            return 0
        k = self.stores[0].k
        return 2 * 2 * k[0].numel() * k.element_size()

    def begin(self, rows: slice, past: int) -> None:
        """A verification pass of `rows` whose committed past is [0, past): issue layers 0 and 1."""
        if self.k is None:
            self._allocate()
        self.passes += 1
        self.rows, self.past = rows, past
        self.holds = [None, None]
        for layer in range(min(2, len(self.stores))):
            self._issue(layer)

    def acquire(self, layer: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s buffer pair [B, H_kv, L, D] each, its copy of [0, past) complete for the
        compute stream. Raises RuntimeError when the buffer does not hold this layer of this pass."""
        buf = layer % 2
        if self.holds[buf] != (self.passes, layer) or rows != self.rows:
            raise RuntimeError(f"verification: layer {layer} of rows {rows} is not in buffer {buf} "
                               f"(it holds {self.holds[buf]} of rows {self.rows}, pass {self.passes})")
        if self.asynchronous:
            self.waits += 1
            self.ready_in_time += int(self.ready[buf].query())
            self.streams.current_stream().wait_event(self.ready[buf])
        return self.k[buf], self.v[buf]

    def release(self, layer: int) -> None:
        """Layer `layer`'s attention is queued: its buffer takes layer + 2's copy once that is done."""
        buf = layer % 2
        if self.asynchronous:
            self.free[buf].record(self.streams.current_stream())
        self.holds[buf] = None
        if layer + 2 < len(self.stores):
            self._issue(layer + 2)

    def _issue(self, layer: int) -> None:
        """Copy layer `layer`'s store rows [0, past) into buffer layer % 2 (on the side stream where the
        device is asynchronous)."""
        buf, store, rows, past, waste = layer % 2, self.stores[layer], self.rows, self.past, self.whole_rows_waste
        k, v = self.k[buf, rows], self.v[buf, rows]

        def copy() -> int:
            return copy_prefix(k, store.k[rows], past, waste) + copy_prefix(v, store.v[rows], past, waste)

        if not self.asynchronous:
            copy()
        else:
            side = self.transfer.stream
            side.wait_event(self.free[buf])  # the previous reader of this buffer is done with it
            self.streams.launch(side, copy)
            self.ready[buf].record(side)
        self.holds[buf] = (self.passes, layer)
        self.copied_bytes += 2 * prefix_bytes(store.k[rows], past, waste)

    def _allocate(self) -> None:
        """The two buffer pairs, zeroed (rows past a row's own positions are read masked: never NaN)."""
        k = self.stores[0].k
        self.k = torch.zeros((2, *k.shape), dtype=k.dtype, device=self.transfer.device)  # [2, B, H_kv, L, D]
        self.v = torch.zeros_like(self.k)
        if self.asynchronous:  # the side stream writes them: after the zero fill, and never freed under a copy
            current = self.streams.current_stream()
            for event in self.free:
                event.record(current)
            self.streams.record_stream(self.k, self.transfer.stream)
            self.streams.record_stream(self.v, self.transfer.stream)

    def stats(self) -> dict:
        """--json: mean bytes copied per verification, and the share of layers whose copy had completed
        when their attention needed it (asynchronous devices); None where the store is read in place."""
        return {"verify_copy_bytes": self.copied_bytes // self.passes if self.passes else None,
                "verify_overlap_share": round(self.ready_in_time / self.waits, 4) if self.waits else None}


def copy_prefix(dst: torch.Tensor, src: torch.Tensor, n: int, whole_rows_waste: float) -> int:
    """dst[:, :, :n] = src[:, :, :n] for contiguous [b, H_kv, L, D] tensors (non_blocking), as copies of
    contiguous memory: all of src at once when the positions past n are at most whole_rows_waste of L
    (fewer copies for a few more bytes), else one copy per (row, KV head). -> bytes copied."""
    b, h, length, d = src.shape
    if n == 0:
        return 0
    if length - n <= whole_rows_waste * length:
        dst.copy_(src, non_blocking=True)
    else:
        flat_dst, flat_src = dst.view(b * h, length, d), src.view(b * h, length, d)
        for i in range(b * h):
            flat_dst[i, :n].copy_(flat_src[i, :n], non_blocking=True)
    return prefix_bytes(src, n, whole_rows_waste)


def prefix_bytes(src: torch.Tensor, n: int, whole_rows_waste: float) -> int:
    """The bytes copy_prefix moves for src [b, H_kv, L, D] and n (known before the copy runs: it may be queued)."""
    b, h, length, d = src.shape
    if n == 0:
        return 0
    if length - n <= whole_rows_waste * length:
        return src.numel() * src.element_size()
    return b * h * n * d * src.element_size()
