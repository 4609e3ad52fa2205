"""The model's own sliding-window layers (Mistral v0.1, Qwen2 with use_sliding_window, Gemma 2 / 3,
Phi-3): a query at position p sees the keys at positions (p - W, p], as transformers' mask does
(masking_utils.sliding_window_overlay). Such a layer never needs more than its window, so in every
cache mode it keeps exactly that: exact K/V in a ring buffer of W + slack slots on the device (slot
= position mod capacity), no host store, no guide. The global layers of the same model keep the
configured policy (engine.kvcache.make_cache).

The slack holds one pass's new tokens (a prefill chunk, or exact mode's gamma + 1 verification
tokens) without overwriting a position that a query of the same pass still sees: a pass of T tokens
from position s writes slots of positions up to s + T - 1 - capacity, and its first query needs
positions from s - W + 1, so capacity >= W + T - 1 suffices (sizes.sliding_slots)."""
from __future__ import annotations

import torch

from engine.backends.host_pages import MappedFile
from engine.backends.kernels import backend_for

from engine.config import CacheConfig
from engine.kvcache.base import (
    CacheLayer,
    ModelShape,
    Step,
    additive_mask,
    grouped_query,
    import_tensors,
    masked_attention,
    bf16_prefill_attention,
    ungroup_output,
)
from engine.kvcache.sizes import layer_kv_bytes_per_token, sliding_kept_tokens, sliding_slots
from engine.kvcache.transfer import Transfer


def sliding_kernel(device: torch.device) -> str:
    """Which code decodes the sliding-window layers on this device (--json: run_stats): its backend's
    (engine.backends: "native" on a CPU with the library, one call per layer and pass instead of ~10 torch
    ops), else "torch", the reference (SlidingWindowLayer.attend_torch)."""
    backend = backend_for(device)
    return backend.implements()["sliding_attention"] if backend.available() else "torch"


class SlidingWindowLayer(CacheLayer):
    """Exact K/V of the last `capacity` positions per row in a ring; attention masked to the window.
    Not a `--cache` policy (not registered): the model chooses it per layer (make_cache)."""

    @classmethod
    def build(cls, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device, transfer: Transfer, window: int | None = None) -> "SlidingWindowLayer":
        """The window layer of a model layer that attends within `window` (it shares no transfer)."""
        if window is None:
            raise ValueError("a sliding-window layer needs the model's window")
        return cls(shape, config, batch, max_len, dtype, device, window)

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, window: int):
        self.shape, self.window = shape, window
        self.capacity = sliding_slots(window, config.chunk_size, max_len)
        h, d = shape.kv_heads, shape.head_dim
        self.k = torch.zeros(batch, h, self.capacity, d, dtype=dtype, device=device)  # [B, H_kv, C, D]
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)  # [B, C] position per slot

    def _slots(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [b, 1], positions [b, T], their slots [b, T]) of the pass's new tokens: the same in every sliding
        layer of a pass (same capacity), built once."""
        def build():
            b = step.start.shape[0]
            rows = torch.arange(step.rows.start, step.rows.start + b, device=self.k.device)[:, None]
            pos = step.positions()
            return rows, pos, pos % self.capacity

        return step.shared_value(("slots", self.capacity, self.k.device), build)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """Write the new tokens' K/V [b, H_kv, T, D] into their ring slots (over the oldest positions)."""
        rows, pos, slots = self._slots(step)
        self.k[rows, :, slots] = k.transpose(1, 2)  # advanced dims first: [b, T, H_kv, D]
        self.v[rows, :, slots] = v.transpose(1, 2)
        self.pos[rows, slots] = pos

    def window_mask(self, step: Step, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [b, 1, G*T, C]: query t of a row sees the slots holding positions in
        (p_t - W, p_t]; empty slots (-1) and positions past the query never."""
        kpos = self.pos[step.rows][:, None, :]  # [b, 1, C]
        qpos = step.positions()[:, :, None]  # [b, T, 1]
        allowed = (kpos >= 0) & (kpos <= qpos) & (kpos > qpos - self.window)  # [b, T, C]
        return additive_mask(allowed.repeat(1, group, 1)[:, None], dtype)

    def attend(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """q [b, H, T, D] -> [b, T, H, D]: exact attention over the ring, masked to each query's window. A
        decode pass (fp32) takes the device's kernel (sliding_kernel), else the torch reference."""
        if not step.prefill and not step.fixed and q.dtype == torch.float32 and self.k.dtype == torch.float32 \
                and sliding_kernel(q.device) != "torch":
            return self.attend_native(q, scaling, step, softcap)
        if step.prefill and step.compute == torch.bfloat16 and softcap is None and q.shape[0] == 1 and q.is_cpu:
            out = self.attend_prefill_bf16(q, scaling, step)
            if out is not None:
                return out
        return self.attend_torch(q, scaling, step, softcap)

    def attend_prefill_bf16(self, q: torch.Tensor, scaling: float, step: Step) -> torch.Tensor | None:
        """A bf16 prefill chunk of one row by the CPU's bf16 kernel (engine.kvcache.passes.bf16_prefill_attention,
        as the global layers take it) over the ring's slots of positions (s - W, s + T) in order: one or two
        pieces, since they fit the ring (sizes.sliding_slots) and wrap at most once. The fp32 masked SDPA it
        replaces took a fifth of Gemma 3 270M's prefill. -> [1, T, H, D], or None where no kernel applies."""
        row, s, t, cap = step.rows.start, step.starts[0], step.n_new, self.capacity
        first = max(0, s - self.window + 1)
        a, n = first % cap, s + t - first
        k, v = self.k[row : row + 1], self.v[row : row + 1]
        cut = [(a, min(cap, a + n))] + ([(0, a + n - cap)] if a + n > cap else [])
        out = bf16_prefill_attention(q, [(k[:, :, i:j], v[:, :, i:j]) for i, j in cut], scaling, s, first,
                                     self.window)
        return None if out is None else ungroup_output(out.to(q.dtype), self.shape.heads, t)

    def attend_native(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None) -> torch.Tensor:
        """attend by the C kernel (engine/native/attention_kernels.c): q [b, H, T, D] fp32 over the ring of the
        rows step.rows, each row's first new position step.start -> [b, T, H, D] (attend_torch's, to float
        rounding)."""
        qg = grouped_query(q, self.shape.kv_heads)  # [b, H_kv, G*T, D]
        if qg.stride(3) != 1 or qg.stride(2) != qg.shape[3]:
            qg = qg.contiguous()
        out = backend_for(q.device).sliding_attention(self, qg, scaling, step, softcap)
        if out is None:  # (the backend declined these inputs)
            return self.attend_torch(q, scaling, step, softcap)
        return ungroup_output(out, self.shape.heads, step.n_new)

    def attend_torch(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """The torch reference of attend (every device, prefill chunks, the kernel's tests). The mask is the
        same in every sliding layer of a pass (same writes, same capacity): built once."""
        qg = grouped_query(q, self.shape.kv_heads)  # [b, H_kv, G*T, D]
        mask = step.shared_value(("sliding", self.window, self.capacity, q.dtype),
                                 lambda: self.window_mask(step, self.shape.group, q.dtype))
        out = masked_attention(qg, self.k[step.rows], self.v[step.rows], mask, scaling, softcap)
        return ungroup_output(out, self.shape.heads, step.n_new)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row dst becomes a copy of row src (its ring holds at most the positions that matter)."""
        for t in (self.k, self.v, self.pos):
            t[dst] = t[src]

    def _kept(self, length: int) -> torch.Tensor:
        """Slots of the positions a row of `length` tokens still needs: the last min(length, W). -> [n]"""
        n = sliding_kept_tokens(self.window, length)
        return torch.arange(length - n, length, device=self.k.device) % self.capacity

    def export_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """The window of row `row` after `length` tokens, in position order (for the document store)."""
        slots = self._kept(length)
        return {"k": self.k[row, :, slots], "v": self.v[row, :, slots]}

    def import_row(self, row: int, length: int, tensors: dict[str, torch.Tensor], check: bool = False,
                   pages: MappedFile | None = None) -> None:
        """Make row `row` (fresh) hold an export_row() of `length` tokens (check: only validate; its window is
        copied whatever pages is)."""
        slots = self._kept(length)
        import_tensors({"k": self.k[row, :, slots], "v": self.v[row, :, slots]}, tensors, check, strict=True)
        if not check:
            self.k[row, :, slots] = tensors["k"]
            self.v[row, :, slots] = tensors["v"]
            self.pos[row] = -1
            self.pos[row, slots] = torch.arange(length - slots.numel(), length, device=self.pos.device)

    def device_bytes(self, lengths: torch.Tensor, element_size: int | None = None) -> int:
        """Exact K/V of the window per row (what it keeps; the slack only passes through)."""
        kept = sum(sliding_kept_tokens(self.window, int(n)) for n in lengths.tolist())
        return kept * layer_kv_bytes_per_token(self.shape, element_size or self.k.element_size())

    def allocated_device_bytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size() // self.k.shape[0]

    def run_stats(self, layers: list) -> dict:
        return {"sliding_window": self.window, "sliding_kernel": sliding_kernel(self.k.device)}
