"""The host side of the exact store (engine/kvcache/host_store.py): the prefetch worker thread and the gathers
of exact K/V rows from the store (its memory, which CUDA may pin in place: engine/backends/host_mapping.py)."""
from __future__ import annotations

import queue
import threading

import torch


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


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, h, j] = src[b, h, idx[b, h, j]]: whole D-vectors, copied as rows (index_select) rather
    than element by element (gather), widened to out's dtype (a 16-bit store's rows into an fp32 fetched
    set). src [b, H_kv, L, D], idx [b, H_kv, k], out [b, H_kv, k, D]."""
    b, h, length, d = src.shape
    base = torch.arange(b * h, device=idx.device).view(b, h, 1) * length
    flat = (idx + base).reshape(-1)
    if src.is_contiguous() and out.is_contiguous() and src.dtype == out.dtype:
        torch.index_select(src.view(-1, d), 0, flat, out=out.view(-1, d))
    else:
        out.copy_(src.reshape(-1, d).index_select(0, flat).view(out.shape))


def corrected_rows_fixed(fk: torch.Tensor, fv: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                         idx: torch.Tensor, old_idx: torch.Tensor, old_valid: torch.Tensor, in_place=None):
    """corrected_rows at fixed shapes and without a host read (a recorded pass, Step.fixed): each slot of idx
    [b, H_kv, k] matched against the k fetched positions old_idx (valid where old_valid) pairwise, the
    matches taken from fk/fv [b, H_kv, k, D], every other slot read from the host store host_k/v: with
    in_place (a pinned, mapped store: the device backend's Kernels.gather_rows) by its gather of those slots
    only (the store read over the bus) where it runs, else gathered whole and chosen by torch.where.
    -> (k rows, v rows, reused [b, H_kv, k] bool)."""
    d = fk.shape[-1]
    eq = (idx[..., :, None] == old_idx[..., None, :]) & old_valid[..., None, :]  # [b, H_kv, k, k]
    reused = eq.any(-1)
    rows = eq.to(torch.uint8).argmax(-1)[..., None].expand(-1, -1, -1, d)
    k, v = fk.gather(2, rows), fv.gather(2, rows)
    missing = ~reused
    if in_place is not None and in_place(host_k, host_v, idx, k, v, only=missing):
        return k, v, reused
    got_k = torch.empty(*idx.shape, d, dtype=host_k.dtype, device=host_k.device)
    got_v = torch.empty_like(got_k)
    gather_rows(host_k, idx.to(host_k.device), got_k)
    gather_rows(host_v, idx.to(host_k.device), got_v)
    miss = missing[..., None]
    return torch.where(miss, got_k.to(k.device, k.dtype), k), torch.where(miss, got_v.to(v.device, v.dtype), v), reused


def corrected_rows(fk: torch.Tensor, fv: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor, idx: torch.Tensor,
                   old_idx: torch.Tensor, old_valid: torch.Tensor, bound: int | None = None):
    """The exact K/V rows at positions idx [b, H_kv, k]: from the fetched rows fk/fv [b, H_kv, k, D] (of
    positions old_idx where old_valid) where they hold the position, else from the host store host_k/v
    [b, H_kv, L, D], only those crossing to the fetched rows' device (compacted: missing slots first,
    as many as the most of any head); bound: above every position of idx and old_idx (else read from them).
    -> (k rows, v rows [b, H_kv, k, D], reused [b, H_kv, k] bool)."""
    b, h, n = idx.shape
    d, dev = fk.shape[-1], fk.device
    top = bound if bound is not None else int(max(int(idx.max()), int(old_idx.max()))) + 1  # a trash column there
    slot = torch.full((b, h, top + 1), -1, dtype=torch.long, device=dev)  # position -> slot holding it
    slot.scatter_(-1, torch.where(old_valid, old_idx, top), torch.arange(old_idx.shape[-1], device=dev).expand(b, h, -1))
    where = slot.gather(-1, idx)  # [b, H_kv, k]
    reused = where >= 0
    rows = where.clamp(min=0)[..., None].expand(-1, -1, -1, d)
    k, v = fk.gather(2, rows), fv.gather(2, rows)
    missing = ~reused
    m = int(missing.sum(-1).max())
    if m:
        order = torch.argsort(missing.to(torch.int8), dim=-1, descending=True, stable=True)[..., :m]  # [b, H_kv, m]
        pos = idx.gather(-1, order).to(host_k.device)
        got_k = torch.empty(b, h, m, d, dtype=host_k.dtype, device=host_k.device)
        got_v = torch.empty_like(got_k)
        gather_rows(host_k, pos, got_k)
        gather_rows(host_v, pos, got_v)
        at = order[..., None].expand(-1, -1, -1, d)
        k.scatter_(2, at, got_k.to(dev, k.dtype, non_blocking=True))  # (a 16-bit store's rows widened)
        v.scatter_(2, at, got_v.to(dev, v.dtype, non_blocking=True))
    return k, v, reused
