"""All host<->device transfer code: the exact host store and the prefetch of fetched rows.

On a CUDA device the store lives in pinned host memory; the gather of the predicted top-k
rows goes into a reusable pinned staging buffer and crosses to the device on a side stream,
with an event the next attention waits on. On the CPU the same calls are plain copies.
"""
from __future__ import annotations

import torch


class HostStore:
    """Exact K/V of every token of every row of one layer: [B, H_kv, L, D] each, preallocated."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, k_max: int,
                 dtype: torch.dtype, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)  # [B, H_kv, L, D] host
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)
        fshape = (batch, kv_heads, max(k_max, 1), head_dim)
        # the fetched set on the device: exact K/V of the selected positions, [B, H_kv, k, D]
        self.fk = torch.zeros(fshape, dtype=dtype, device=device)
        self.fv = torch.zeros(fshape, dtype=dtype, device=device)
        if self.cuda:
            self.stage_k = torch.zeros(fshape, dtype=dtype, pin_memory=True)
            self.stage_v = torch.zeros(fshape, dtype=dtype, pin_memory=True)
            self.stream = torch.cuda.Stream(device=device)
            self.ready = torch.cuda.Event()
            self.started = torch.cuda.Event()
        self.pending = False

    def write(self, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens: rows [b, 1], pos [b, T], k/v [b, H_kv, T, D] (device) -> host."""
        if self.cuda:
            k, v = k.to("cpu"), v.to("cpu")
            rows, pos = rows.cpu(), pos.cpu()
        self.k[rows, :, pos] = k.transpose(1, 2)  # advanced dims first: [b, T, H_kv, D]
        self.v[rows, :, pos] = v.transpose(1, 2)

    def read(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V of one row's positions [start, end) on the compute device. -> [1, H_kv, n, D] each."""
        k, v = self.k[row : row + 1, :, start:end], self.v[row : row + 1, :, start:end]
        if self.cuda:
            return k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
        return k, v

    def prefetch(self, rows: slice, idx: torch.Tensor) -> None:
        """Start fetching the exact K/V at idx [b, H_kv, k] (positions) into the device fetched set."""
        n = idx.shape[-1]
        gidx = idx[..., None].expand(-1, -1, -1, self.k.shape[-1])  # [b, H_kv, k, D]
        if not self.cuda:
            torch.gather(self.k[rows], 2, gidx, out=self.fk[rows, :, :n])
            torch.gather(self.v[rows], 2, gidx, out=self.fv[rows, :, :n])
            return
        self.started.record()
        gidx_host = gidx.to("cpu")
        torch.gather(self.k[rows], 2, gidx_host, out=self.stage_k[rows, :, :n])
        torch.gather(self.v[rows], 2, gidx_host, out=self.stage_v[rows, :, :n])
        with torch.cuda.stream(self.stream):
            self.fk[rows, :, :n].copy_(self.stage_k[rows, :, :n], non_blocking=True)
            self.fv[rows, :, :n].copy_(self.stage_v[rows, :, :n], non_blocking=True)
            self.ready.record(self.stream)
        self.pending = True

    def fetched(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The fetched set for rows, after making the compute stream wait for the prefetch."""
        if self.pending:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.pending = False
        return self.fk[rows], self.fv[rows]

    def host_bytes(self, tokens: int) -> int:
        """Bytes of exact K and V held for `tokens` tokens of this layer."""
        return 2 * tokens * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
