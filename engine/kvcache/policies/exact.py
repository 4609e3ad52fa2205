"""Exact mode: the specache cache drafts, the exact host store verifies (the full cache's output).

The layer is a SpecacheLayer (guide + sinks + residual window + fetched set, the exact K/V of every
token in the host store) with one more kind of pass. The step loop (engine.generate.steps.exact_cycles)
runs cycles:

- draft: gamma passes of one token each with the guided attention of specache; each commits as a
  draft (KVCache.commit(draft=True): the lengths move so the next draft token sees this one, no
  boundary moves, nothing is quantized; Step.draft: nothing enters the host store on a GPU, which
  saves a blocking device-to-host copy per row and layer; on a CPU the residual window is the store's
  memory, so a draft's K/V lands there past the committed length, where the verification rewrites
  it), and KVCache.rollback() restores the committed lengths.
  A draft pass picks its own fetched set from its guide attention (prefetch "current") whatever the
  configured prefetch: the speculative prefetch would pick the next set among positions that a
  draft's boundary never quantizes.
- verify: one pass of [last committed token, the gamma drafts] with Step.exact and keep = T: `update`
  writes every new token's K/V into the host store, sinks and residual window (at the same positions
  the drafts wrote, so no draft K/V survives), and `attend` is the full cache's exact attention
  (engine.kvcache.policies.full.exact_attention) over the store rows [0, max(start) + T). The cache then
  commits a per-row number of tokens (KVCache.commit(kept)); the groups that left the residual
  window are quantized from the store as after any commit. The cache then holds exactly what a
  cache that only ever saw the accepted tokens would hold.

On the CPU the store is read in place (no copy). On CUDA the store is in pinned host memory and a
verification streams it through two device buffers (engine.kvcache.verify_stream.VerifyStream, the
cache's one, shared by its layers): layer 0's `update` starts the pass (the copies of layers 0 and 1
of the committed past [0, max(start)) go out on the side stream); each layer's `attend` waits for its
own copy, writes the pass's new tokens (kept from `update`, already on the device) into the buffer
at each row's positions, attends over it and releases it, which issues the copy of layer l + 2 into
the same buffer: layer l + 1's copy runs while layer l computes. The store write of the new tokens
(`update`) is unchanged: the accepted tokens are committed from the store. The staged path can be
forced on the CPU (Transfer.stream_verify, tests only), where it gives the in-place path's
attention bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import CacheConfig
from engine.kvcache.base import ModelShape, Step, write_rows
from engine.kvcache.policies.full import FullLayer, exact_attention
from engine.kvcache.registry import register
from engine.kvcache.sizes import PlanTerms, Sizing, store_at_compute_dtype, verify_buffer_bytes
from engine.kvcache.policies.specache import SpecacheLayer
from engine.kvcache.transfer import Transfer


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens per row per verification when each draft token is accepted with probability a (the
    accepted run is geometric, cut at gamma) plus the exact token: (1 - a^(gamma+1)) / (1 - a)."""
    if acceptance >= 1:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


@register("exact")
class ExactLayer(SpecacheLayer):
    """A specache layer that drafts with the guide and verifies with the exact host store."""
    listed = 4  # its place in --cache's list (engine.kvcache.registry)

    verifies = True  # decoded by engine.generate.steps.exact_steps (draft, then one exact pass)
    watches = False  # its output is the exact store's: a lost guide only costs acceptance
    summary = "specache drafts, the exact store verifies: the output of full"
    # `specache plan` has an exact column (its verification's figures); a run's batch is planned as
    # its draft cache's, specache's
    plan_mode = "specache"
    # its drafts launch specache's (prefetch current) kernels; a verification, a full pass's (a model, not
    # counted: CacheLayer.decode_launches)
    verify_launches = FullLayer.decode_launches

    @classmethod
    def speculates(cls, config: CacheConfig) -> bool:
        return False  # its drafts pick their own sets (prefetch "current")

    store_on_update = True  # a verification reads every committed position from the store

    @classmethod
    def exact_store_dtype(cls, config: CacheConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """The compute dtype, whatever the setting: the verification attends with the store, as full does."""
        return dtype

    @classmethod
    def plan_sizing(cls, terms: PlanTerms) -> Sizing:
        """specache's sizing (its drafts) with the store in the compute dtype, plus on a GPU with its own
        memory the buffers one verification streams every layer's exact K/V through."""
        s = super().plan_sizing(store_at_compute_dtype(terms))
        if terms.streams and terms.layers.layers:
            return s.adding({"verify_buffers": verify_buffer_bytes(terms.model, terms.context, terms.element_bytes)})
        return s

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, transfer: Transfer):
        super().__init__(shape, replace(config, prefetch="current"), batch, max_len, dtype, device, transfer)
        self.verify = transfer.verify_stream()
        self.index = self.verify.add(self.store)  # this layer's place in the verification's copy order
        self.new_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # a staged verification's new K/V

    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """As specache (the store, sinks and residual get the new tokens); in a staged verification
        layer 0 also starts the pass's copies, and each layer keeps its new K/V [b, H_kv, T, D] for attend."""
        if step.exact and self.verify.staged:
            if self.index == 0:
                self.verify.begin(step.rows, max(step.starts))
            self.new_kv = (k, v)
        super().update(k, v, step)

    def attend(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """q [b, H, T, D] -> [b, T, H, D]: a verification attends exactly over every committed K/V
        and the new tokens (the store in place, or this layer's streamed buffer), any other pass as
        specache does."""
        if not step.exact:
            return super().attend(q, scaling, step, softcap)
        length = max(step.starts) + step.n_new
        if not self.verify.staged:
            keys, values = self.store.k[step.rows, :, :length], self.store.v[step.rows, :, :length]
            if keys.device != q.device:  # CUDA with stream_verify off: a plain copy on the compute stream
                self.store.transfer.host_ready()  # (after the store's own copies of the new tokens)
                keys, values = keys.to(q.device, non_blocking=True), values.to(q.device, non_blocking=True)
            return exact_attention(q, keys, values, scaling, step, self.shape, softcap)
        keys, values = self.verify.acquire(self.index, step.rows)  # [B, H_kv, L, D]: the past of [0, max(start))
        (k_new, v_new), self.new_kv = self.new_kv, None
        write_rows(keys, values, k_new, v_new, step)
        out = exact_attention(q, keys[step.rows, :, :length], values[step.rows, :, :length], scaling, step,
                              self.shape, softcap)
        self.verify.release(self.index)
        return out

    def run_stats(self, layers: list["ExactLayer"]) -> dict:
        """The draft's settings (exact mode's own figures come from the step loop: KVCache.decode_stats)."""
        stats = super().run_stats(layers)
        stats["draft"] = "specache"
        stats.update(self.verify.stats())
        return stats
