"""The full cache: every token's exact K/V on the device (the reference the other policies are measured against)."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kvcache.base import (
    CacheLayer,
    ModelShape,
    Step,
    additive_mask,
    causal_mask,
    grouped_query,
    masked_attention,
    bf16_prefill_attention,
    split_attention_applies,
    split_prefill_attention,
    ungroup_output,
    write_rows,
)
from engine.kvcache.registry import register
from engine.kvcache.sizes import PlanTerms, Sizing, exact_cache_sizing, layer_kv_bytes_per_token
from engine.kvcache.transfer import Transfer


def exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, step: Step,
                    shape: ModelShape, softcap: float | None = None) -> torch.Tensor:
    """Exact causal attention of the step's new tokens' queries q [b, H, T, D] over each row's
    exact K/V keys/values [b, H_kv, max(start) + T, D] (positions past a row's own are masked)
    -> [b, T, H, D] (softcap: the model's attention-logit softcapping). The full cache's attention;
    exact mode's verification pass reuses it."""
    length = keys.shape[2]
    qg = grouped_query(q, shape.kv_heads)
    mask = step.shared_value(("causal", shape.group, length, q.dtype),
                             lambda: additive_mask(causal_mask(step, shape.group, length), q.dtype))
    out = masked_attention(qg, keys, values, mask, scaling, softcap)
    return ungroup_output(out, shape.heads, step.n_new)


@register("full")
class FullLayer(CacheLayer):
    """Exact K/V of every token, preallocated to the planned length (no growth by concatenation)."""
    listed = 0  # its place in --cache's list (engine.kvcache.registry)

    capturable = True
    decode_launches = (39, 28)  # (CacheLayer.decode_launches)

    @classmethod
    def plan_sizing(cls, terms: PlanTerms) -> Sizing:
        """Every token's exact K/V on the device (engine.kvcache.sizes.exact_cache_sizing)."""
        return exact_cache_sizing(terms)

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, transfer: Transfer):
        self.shape = shape
        self.k = torch.zeros(batch, shape.kv_heads, max_len, shape.head_dim, dtype=dtype, device=device)  # [B, H_kv, L, D]
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """Write the new tokens' K/V ([b, H_kv, T, D]) at their positions."""
        write_rows(self.k, self.v, k, v, step)

    def attend(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """Exact attention of q [b, H, T, D] over each row's past and new tokens -> [b, T, H, D].
        A prefill chunk on the CPU: the past without a mask, the chunk's block causal, merged
        (split_prefill_attention); otherwise one SDPA call with the causal mask of the pass (or,
        with a softcap, which the flash kernels cannot apply, the eager order: masked_attention)."""
        if split_attention_applies(q, step) and softcap is None:
            s, t = step.starts[0], step.n_new
            r = step.rows
            out = bf16_prefill_attention(q, [(self.k[r, :, : s + t], self.v[r, :, : s + t])], scaling, s) \
                if step.compute == torch.bfloat16 else None
            out = out if out is not None else split_prefill_attention(q, [(self.k[r, :, :s], self.v[r, :, :s])], self.k[r, :, s : s + t],
                                          self.v[r, :, s : s + t], scaling)
            return ungroup_output(out.to(q.dtype), self.shape.heads, t)
        length = self.k.shape[2] if step.fixed else max(step.starts) + step.n_new  # (fixed: masked past the rows)
        return exact_attention(q, self.k[step.rows, :, :length], self.v[step.rows, :, :length], scaling, step,
                               self.shape, softcap)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Make row dst hold row src's first `length` tokens (a shared document prefix)."""
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]

    def export_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Row `row`'s state after `length` tokens (views), for the document store."""
        return {"k": self.k[row, :, :length], "v": self.v[row, :, :length]}

    def device_bytes(self, lengths: torch.Tensor, element_size: int | None = None) -> int:
        return int(lengths.sum()) * layer_kv_bytes_per_token(self.shape, element_size or self.k.element_size())

    def allocated_device_bytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size() // self.k.shape[0]
