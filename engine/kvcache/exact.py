"""Exact mode: the specache cache drafts, the exact host store verifies (the full cache's output).

The layer is a SpecacheLayer (guide + sinks + residual window + fetched set, the exact K/V of every
token in the host store) with one more kind of pass. The step loop (engine.generate.steps.exact_cycles)
runs cycles:

- draft: gamma passes of one token each with the guided attention of specache; each commits as a
  draft (KVCache.commit(draft=True): the lengths move so the next draft token sees this one, no
  boundary moves, nothing is quantized), and KVCache.rollback() restores the committed lengths.
  A draft pass picks its own fetched set from its guide attention (prefetch "current") whatever the
  configured prefetch: the speculative prefetch would pick the next set among positions that a
  draft's boundary never quantizes.
- verify: one pass of [last committed token, the gamma drafts] with Step.exact and keep = T: `update`
  writes every new token's K/V into the host store, sinks and residual window (at the same positions
  the drafts wrote, so no draft K/V survives), and `attend` is the full cache's exact attention
  (engine.kvcache.full.exact_attention) over the store rows [0, max(start) + T). The cache then
  commits a per-row number of tokens (KVCache.commit(kept)); the groups that left the residual
  window are quantized from the store as after any commit. The cache then holds exactly what a
  cache that only ever saw the accepted tokens would hold.

On the CPU the store is read in place. On CUDA the store is in pinned host memory and a
verification copies each layer's rows to the device when the layer needs them (a plain copy: the
double-buffered side-stream stream of layer l + 1 during layer l is not done).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import CacheConfig
from engine.kvcache.base import ModelShape, Step
from engine.kvcache.full import exact_attention
from engine.kvcache.registry import register
from engine.kvcache.specache import SpecacheLayer
from engine.kvcache.transfer import Transfer


@register("exact")
class ExactLayer(SpecacheLayer):
    """A specache layer that drafts with the guide and verifies with the exact host store."""

    verifies = True  # decoded by engine.generate.steps.exact_steps (draft, then one exact pass)

    @classmethod
    def speculates(cls, config: CacheConfig) -> bool:
        return False

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, transfer: Transfer):
        super().__init__(shape, replace(config, prefetch="current"), batch, max_len, dtype, device, transfer)

    def attend(self, q: torch.Tensor, scaling: float, step: Step) -> torch.Tensor:
        """q [b, H, T, D] -> [b, T, H, D]: a verification attends exactly over the host store,
        any other pass as specache does."""
        if not step.exact:
            return super().attend(q, scaling, step)
        length = max(step.starts) + step.n_new
        keys, values = self.store.k[step.rows, :, :length], self.store.v[step.rows, :, :length]
        if keys.device != q.device:  # CUDA: the store is pinned host memory
            keys, values = keys.to(q.device, non_blocking=True), values.to(q.device, non_blocking=True)
        return exact_attention(q, keys, values, scaling, step, self.shape)

    def run_stats(self, layers: list["ExactLayer"]) -> dict:
        """The draft's settings (exact mode's own figures come from the step loop: KVCache.decode_stats)."""
        stats = super().run_stats(layers)
        stats["draft"] = "specache"
        return stats
