"""SpeCache (Jie et al., ICML 2025; docs/algorithm.md): the guide and, per layer and KV head, the exact K/V of the top-k
positions, selected by the attention row of the speculative token (prefetch "speculative") or of the
token itself (prefetch "current") and fetched from the exact host store."""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import CacheConfig
from engine.kvcache.base import ModelShape, Step
from engine.kvcache.fused import reproduces
from engine.kvcache.guided import GuidedLayer, Layout
from engine.kvcache.registry import register
from engine.kvcache.sizes import (
    FETCH_BUFFERS,
    PAPER_FETCH_BUFFERS,
    SPECULATIVE_TOKENS,
    PlanTerms,
    Sizing,
    decode_working_set_bytes,
    fetch_buffer_bytes,
    quant_boundary,
)
from engine.kvcache.transfer import Transfer


@register("specache")
@reproduces
class SpecacheLayer(GuidedLayer):
    """Guide + sinks + residual window + the fetched set of k exact positions (k = config.k)."""
    listed = 1  # its place in --cache's list (engine.kvcache.registry)

    fetches = True
    watches = True  # its decode is checked against the exact store (engine/kvcache/watch.py)
    decode_launches = (103, 20)  # (CacheLayer.decode_launches) with prefetch current; speculative_launches with
    speculative_launches = (147, 22)  # the corrected set (the torch decode); fused_launches without it: the fused
    fused_launches = (41, 22)  # Triton decode's (engine/backends/triton_decode.py: 5 kernels + 3 prefetch copies)

    @classmethod
    def speculates(cls, config: CacheConfig) -> bool:
        """Two tokens per step unless nothing is fetched or each token picks its own set (prefetch current)."""
        return config.k > 0 and config.prefetch == "speculative"

    @classmethod
    def step_launches(cls, config: CacheConfig) -> tuple[int, int]:
        """The speculative step without the corrected set is the fused Triton decode's on CUDA (what its kernels
        implement, with $SPECACHE_TRITON_DECODE=1; the planner's column: the method as its roofline models it)."""
        if not cls.speculates(config):
            return cls.decode_launches
        return cls.speculative_launches if config.correct else cls.fused_launches

    @classmethod
    def plan_sizing(cls, terms: PlanTerms) -> Sizing:
        """The guide's sizing, plus the fetched set: its device buffers, k positions read a step, the
        exact store (on the host, or device memory where they are one), and two queries a step under
        the speculative prefetch (the method's, which the planner models)."""
        t, c = terms, terms.cache
        queries = SPECULATIVE_TOKENS if cls.speculates(replace(c, k=1, prefetch="speculative")) else 1
        parts = {"fetch_buffers": fetch_buffer_bytes(t.layers, c.k, t.element_bytes,
                                                     PAPER_FETCH_BUFFERS if t.paper else FETCH_BUFFERS)}
        if t.unified:
            parts["host_store"] = t.context * t.store_kv_bytes
        s = super().plan_sizing(t)
        return s.adding(parts, queries=queries, read_per_sequence=s.read_per_sequence + c.k * t.store_kv_bytes,
                        host_per_sequence=t.context * t.store_kv_bytes,
                        decode_working_set=decode_working_set_bytes(t.model, t.context, queries, t.element_bytes,
                                                                    guided=True))

    @classmethod
    def layout(cls, shape: ModelShape, config: CacheConfig, max_len: int, dtype: torch.dtype) -> Layout:
        """kivi's, and k exact positions fetched (config.fetch_k: a default k grows with the cache's length)."""
        return replace(super().layout(shape, config, max_len, dtype), topk=config.fetch_k(max_len))

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, transfer: Transfer):
        super().__init__(shape, config, batch, max_len, dtype, device, transfer)
        self.hits = self.hit_total = 0  # prefetch hit counts (config.measure_hits)
        # corrected sets: slots the prefetch had brought, slots in all (summed on the device in place, the same
        # op every pass, as a recorded one needs; read once by run_stats)
        self.reused = torch.zeros((), dtype=torch.long, device=device)
        self.reuse_total = torch.zeros((), dtype=torch.long, device=device)

    def count_hits(self, qg, rscores, idx, step: Step, nq: int, scaling: float) -> None:
        """Prefetch hit rate: the share of the output token's exact top-k guide positions (by exact
        attention, summed over the query heads of each KV head) that had been fetched. Costs a full
        attention over the exact store, so only when asked for."""
        b, h, g, t = qg.shape[0], self.shape.kv_heads, self.shape.group, step.n_new
        rows = step.rows
        self.store.transfer.host_ready()
        k_exact = self.store.k[rows, :, :nq].to(qg.device, qg.dtype)  # [b, H_kv, nq, D] (a 16-bit store widened)
        q0 = qg.view(b, h, g, t, -1)[:, :, :, 0]  # the output token's queries [b, H_kv, G, D]
        exact = (q0 @ k_exact.transpose(-1, -2)).float() * scaling  # [b, H_kv, G, nq]
        res0 = rscores.view(b, h, g, t, -1)[:, :, :, 0]
        p = torch.softmax(torch.cat([exact, res0], dim=-1), dim=-1)[..., :nq].sum(dim=2)  # [b, H_kv, nq]
        pos = torch.arange(nq, device=p.device)
        p = p.masked_fill((pos[None, :] >= self.qend[rows][:, None])[:, None] | (pos < self.sinks), -1.0)
        fetched = torch.zeros(b, h, nq + 1, dtype=torch.bool, device=p.device)
        fetched.scatter_(-1, idx, True)
        top_p, top = p.topk(min(self.topk, nq), dim=-1)
        real = top_p >= 0
        self.hits += int((fetched[..., :nq].gather(-1, top) & real).sum())
        self.hit_total += int(real.sum())

    def select_current(self, scores, rscores, step: Step, nq: int, qend) -> None:
        """prefetch "current" (T = 1): the top-k positions of this pass's own attention with guide
        scores (sinks and residual exact), summed over the query heads of each KV head, become its
        fetched set before it attends."""
        if nq <= self.sinks:
            self.fvalid[step.rows] = False
            return
        self.fetch_top(self.own_attention(scores, rscores, step, nq), qend, step.rows, now=step.fixed)

    def own_attention(self, scores, rscores, step: Step, nq: int) -> torch.Tensor:
        """The output token's (new token 0's) attention with guide scores over the guide region, summed
        over its KV head's query heads: scores [b, H_kv, G*T, nq], rscores [b, H_kv, G*T, residual]
        -> [b, H_kv, nq]."""
        b, h, g = scores.shape[0], self.shape.kv_heads, self.shape.group
        probs = torch.softmax(torch.cat([scores, rscores], dim=-1), dim=-1)  # [b, H_kv, G*T, cols]
        return probs.view(b, h, g, step.n_new, -1)[:, :, :, 0, :nq].sum(dim=2)

    def correct_fetched(self, scores, rscores, step: Step, nq: int, qend) -> None:
        """speculative with config.correct: the output token (new token 0) ranks the guide region by its
        own attention with guide scores (sinks and residual exact), summed over its KV head's query
        heads, as prefetch "current" does; that top-k becomes the fetched set before the pass attends.
        The prefetch (chosen by the previous step's speculative token) supplies the positions it
        holds; the others are fetched now (HostStore.correct). Counts the reuse."""
        rows = step.rows
        if nq <= self.sinks:
            self.fvalid[rows] = False
            return
        idx, valid = self.top_positions(self.own_attention(scores, rscores, step, nq), qend)
        reused = self.store.correct(rows, idx, self.fidx[rows], self.fvalid[rows], nq, fixed=step.fixed)
        if step.n_new > 1:  # a two-token step (the pre-decoding pass has no prefetched set yet)
            self.count_reuse((reused & valid).sum(), valid.sum())
        self.fidx[rows], self.fvalid[rows] = idx, valid

    def count_reuse(self, reused, total) -> None:
        """Add one corrected pass's counts (ints or device scalars): slots the prefetch had brought, valid
        slots in all."""
        self.reused += reused
        self.reuse_total += total

    def select_and_prefetch(self, probs, step: Step, nq: int, n_res: int, qend, rpos) -> None:
        """Top-k positions of the selecting token (summed over its KV head's query heads), among those
        that will be in the guide at the next step; start fetching their exact K/V."""
        b, h, g, t = probs.shape[0], self.shape.kv_heads, self.shape.group, step.n_new
        rows = step.rows
        p = probs.view(b, h, g, t, -1)
        p = p.sum(dim=(2, 3)) if self.config.select_both else p[:, :, :, step.select].sum(dim=2)  # [b, H_kv, cols]
        if step.fixed:  # a recorded pass: the general candidates, sized by the buffers, bounds on the device
            cand = torch.full((b, h, nq + n_res), -1.0, device=p.device)  # (nq: the guide's capacity)
            cand[..., :nq] = p[..., :nq]
            cand.scatter_(-1, rpos[:, None, :].expand(-1, h, -1), p[..., nq + 1 :])
            next_q = quant_boundary(step.start + step.keep, self.residual, self.group)
            self.fetch_top(cand, next_q, rows, fixed=True)
            return
        bounds = [quant_boundary(n + step.keep, self.residual, self.group) for n in step.starts]  # (host)
        span = max(bounds)
        if span <= self.sinks:
            self.fvalid[rows] = False
            return
        next_q = quant_boundary(step.start + step.keep, self.residual, self.group)  # [b] (the same, on the device)
        if any(n > q for n, q in zip(bounds, self.qend_host[rows])):  # a group leaves the residual window: its
            for i, bound in enumerate(bounds):  # positions become candidates (and enter the store now)
                self.flush_to_store(rows.start + i, bound)
            cand = torch.full((b, h, span + n_res), -1.0, device=p.device)  # absolute positions (+ spill)
            cand[..., : min(nq, span)] = p[..., : min(nq, span)]
            cand.scatter_(-1, rpos[:, None, :].expand(-1, h, -1), p[..., nq + 1 :])
        else:  # the usual step: the candidates are the guide region itself
            cand = p[..., :span]
        self.fetch_top(cand, next_q, rows)

    def fetch_top(self, cand: torch.Tensor, bound: torch.Tensor, rows: slice, now: bool = False,
                  fixed: bool = False) -> None:
        """The top-k positions in [S, bound[b]) of cand [b, H_kv, L] (weights >= 0) become the rows'
        fetched set; start fetching their exact K/V (now: gather them on the compute stream, HostStore.gather_now;
        fixed: a recorded pass's prefetch, HostStore.prefetch)."""
        idx, valid = self.top_positions(cand, bound)
        self.fidx[rows] = idx
        self.fvalid[rows] = valid
        if now:
            self.store.gather_now(rows, idx)
        else:
            self.store.prefetch(rows, idx, fixed)

    def before_fixed_pass(self, step: Step) -> None:
        """Host bookkeeping before a recorded pass that selects the next step's set: the positions that leave
        the residual window when it commits are candidates, so they enter the store now (the eager pass does
        this inside, select_and_prefetch; a recorded pass cannot: flush_to_store is the host's copy)."""
        if step.select is None or not self.topk:
            return
        for i, start in enumerate(step.starts):
            row = step.rows.start + i
            bound = quant_boundary(start + step.keep, self.residual, self.group)
            if bound > self.qend_host[row]:
                self.flush_to_store(row, bound)

    def join(self) -> None:
        """The end of a recorded pass: its prefetch brought back into the pass (HostStore.join)."""
        self.store.join()

    def top_positions(self, cand: torch.Tensor, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k positions in [S, bound[b]) of cand [b, H_kv, L] (weights >= 0), padded to the buffer's
        k. -> (idx [b, H_kv, k] long, unused slots 0; valid [b, H_kv, k] bool)."""
        b, h = cand.shape[:2]
        pos = torch.arange(cand.shape[-1], device=cand.device)
        out_of_guide = (pos[None, :] >= bound[:, None]) | (pos[None, :] < self.sinks)  # [b, L]
        cand = cand.masked_fill(out_of_guide[:, None, :], -1.0)
        n = min(self.topk, cand.shape[-1])
        top, idx = cand.topk(n, dim=-1, sorted=False)  # [b, H_kv, n]
        valid = top >= 0
        idx = idx.masked_fill(~valid, 0)  # unused slots fetch position 0 (ignored)
        if n < self.topk:  # pad to the buffer's k so the fetch always fills whole rows
            pad = self.topk - n
            idx = torch.cat([idx, idx.new_zeros(b, h, pad)], dim=-1)
            valid = torch.cat([valid, valid.new_zeros(b, h, pad)], dim=-1)
        return idx, valid

    def run_stats(self, layers: list["SpecacheLayer"]) -> dict:
        """Settings, the prefetch mode and (with config.measure_hits) the measured hit rate."""
        stats = super().run_stats(layers)
        if self.topk:
            stats["prefetch"] = self.config.prefetch
            if self.config.prefetch == "speculative":
                stats["correct"] = self.config.correct
        if self.config.measure_hits:
            hits, total = sum(x.hits for x in layers), sum(x.hit_total for x in layers)
            stats["prefetch_hit_rate"] = round(hits / total, 4) if total else None
        if self.watch is not None:
            stats["guide_check"] = self.watch.stats()
        if self.store.asynchronous and self.topk:  # how the fetched rows crossed: a kernel reading the pinned store in
            in_place = sum(x.store.in_place for x in layers)  # place, or the worker thread's gather and copy
            stats["fetch_path"] = "kernel" if in_place else "thread"
        reused, total = int(sum(x.reused for x in layers)), int(sum(x.reuse_total for x in layers))
        if total:  # corrected speculative sets: the share the prefetch had brought in time
            stats["prefetch_reuse"] = round(reused / total, 4)
        return stats
