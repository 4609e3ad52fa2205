"""Cache layers for the guide-based modes: specache, kivi (k = 0) and window.

Per layer and row, positions [0, qend) are held in the low-bit guide (and, for specache,
exactly in the host store); the newest tokens [qend, len) sit exact in a residual window on
the device, where qend = quant_boundary(len) moves a whole group of g tokens at a time; the
first S tokens also stay exact on the device (attention sinks). The store holds sizes.store_dtype's
elements (16-bit on a CPU: rows widened as they are read). Where it is the device's memory in the compute
dtype (a CPU's fp32 store, exact mode) the residual window is its own positions [qend, ...) (`res_in_store`:
nothing copied or shifted); elsewhere it is a buffer of residual + group + chunk slots per row.

Attention of the new tokens (docs/algorithm.md, "Decode: the guided attention"):
  scores over [0, qend): guide scores, replaced by exact scores at sink and fetched positions;
  scores over [qend, len + T): exact, causal.  One softmax over both.
  output = guide values weighted by the guide-only probabilities + exact values elsewhere.
With select = t, the t-th new token's probabilities, summed over the query heads of each KV
head, pick the top-k positions that will be in the guide at the next step; their exact K/V
are prefetched from the host store while the rest of the step runs. With prefetch "current" (one new token), the
token's own probabilities with guide scores pick the set first and the pass attends with it (the paper's baseline).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import CacheConfig
from engine.kvcache.base import (
    CacheLayer,
    ModelShape,
    Step,
    additive_mask,
    grouped_query,
    masked_attention,
    bf16_prefill_attention,
    split_attention_applies,
    soft_cap,
    split_prefill_attention,
    ungroup_output,
)
from engine.kvcache.fused import fused_applies, fused_decode, fused_write, reproduces, unfused
from engine.kvcache.guide import Guide, GuideSpec
from engine.kvcache.quant import guide_kernel
from engine.kvcache.sizes import PlanTerms, Sizing, guided_sizing, quant_boundary, residual_slots, sink_slots
from engine.kvcache.guided_rows import GuidedRows
from engine.kvcache.host_store import HostStore
from engine.kvcache.transfer import Transfer
from engine.kvcache.watch import WatchedLayer

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Layout:
    """What a guided policy keeps per layer: topk exact positions fetched (0: none), a guide or not, the
    exact residual window and the quantization group (GuidedLayer.layout)."""

    topk: int
    use_guide: bool
    residual: int
    group: int


@reproduces
class GuidedLayer(GuidedRows, WatchedLayer, CacheLayer):
    """The machinery the guide-based policies share (see module docstring); each policy is a subclass
    that fixes how many positions it fetches (topk), whether it keeps a guide and an exact host store,
    and its window (engine/kvcache/policies/specache.py, kivi.py, window.py)."""

    quantizes, guided = True, True
    # where the residual window has buffers of its own (CUDA), committed tokens enter the host store when
    # they leave the window (after_step: one copy per row and KV head a group, not a step); True: at once
    # (exact mode: its verification reads every committed position from the store)
    store_on_update = False

    @classmethod
    def plan_sizing(cls, terms: PlanTerms) -> Sizing:
        """A guide, the residual window and the sinks (engine.kvcache.sizes.guided_sizing): kivi's."""
        return guided_sizing(terms)

    @classmethod
    def layout(cls, shape: ModelShape, config: CacheConfig, max_len: int, dtype: torch.dtype) -> Layout:
        """What the policy keeps (kivi's here: a guide, no fetched set, the configured window and group)."""
        return Layout(topk=0, use_guide=True, residual=config.residual, group=config.group)

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, transfer: Transfer):
        self.shape, self.config = shape, config
        kept = self.layout(shape, config, max_len, dtype)
        self.topk, self.use_guide, self.residual, self.group = kept.topk, kept.use_guide, kept.residual, kept.group
        h, d = shape.kv_heads, shape.head_dim
        self.sinks = config.sinks
        self.sink_k = torch.zeros(batch, h, sink_slots(self.sinks), d, dtype=dtype, device=device)  # [B, H_kv, S, D]
        self.sink_v = torch.zeros_like(self.sink_k)
        self.qend = torch.zeros(batch, dtype=torch.long, device=device)  # [B] quantized prefix per row
        self.qend_host = [0] * batch  # the same on the host: read by every pass without a device sync
        spec = GuideSpec(config.bits, config.group, config.guide_rotation, config.guide_outliers)
        self.guide = Guide(batch, h, max_len, d, spec, device) if self.use_guide else None
        kept_as = self.exact_store_dtype(config, device, dtype)
        self.store = HostStore(batch, h, max_len, d, self.topk, (kept_as, dtype), device, transfer) \
            if self.use_guide else None
        # Where the store is the compute device's memory in the compute dtype (the CPU), the residual window is its
        # positions [qend, qend + W) of each row: nothing copied or shifted. Elsewhere it has buffers of its own.
        self.res_in_store = self.store is not None and transfer.residual_in_store and kept_as == dtype
        if self.res_in_store:
            self.res_k, self.res_v = self.store.k, self.store.v  # [B, H_kv, L, D], read from each row's qend
        else:
            slots = residual_slots(self.residual, self.group, config.chunk_size)  # window + a group waiting + new tokens
            self.res_k = torch.zeros(batch, h, slots, d, dtype=dtype, device=device)  # [B, H_kv, W, D]
            self.res_v = torch.zeros_like(self.res_k)
        self.fidx = torch.zeros(batch, h, max(self.topk, 1), dtype=torch.long, device=device)  # fetched positions
        self.fvalid = torch.zeros(batch, h, max(self.topk, 1), dtype=torch.bool, device=device)
        self.fused = None  # the backend's fused call (engine.kvcache.fused), built on the first pass it applies to
        self.stored = [0] * batch  # per row: positions [0, stored) are in the host store (flush_to_store)
        self.watch = None  # engine.kvcache.watch.GuideWatch of a fetching policy (make_cache attaches it)
        self.kept_q, self.kept_args = None, ()  # a recorded pass's output-token queries, (scaling, softcap): watch.py
        self.recent_q: torch.Tensor | None = None  # the latest pass's queries [1, H_kv, G*<=32, D] (Guide.add: auto rotation)

    # ---- writing -------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """Store the new tokens' K/V [b, H_kv, T, D]: host store, sinks, residual buffer (fused_write: one call).
        Each row's new positions are contiguous, so every write is a slice copy."""
        if fused_write(self, k, v, step):
            return
        if step.fixed:
            self.write_fixed(k, v, step)
            return
        t = k.shape[2]
        starts, qends = step.starts, self.qend_host[step.rows]
        for i, (p0, q0) in enumerate(zip(starts, qends)):
            r = step.rows.start + i
            if self.res_in_store:  # the residual window is the store: every new token goes in (positions past
                self.store.write_span(r, p0, k[i], v[i])  # the committed length are rewritten before they count)
            elif self.store is not None and self.store_on_update and step.keep and not step.draft:  # committed only
                self.store.write_span(r, p0, k[i, :, : step.keep], v[i, :, : step.keep])
            s_end = min(self.sinks, p0 + t)
            if p0 < s_end:
                self.sink_k[r, :, p0:s_end] = k[i, :, : s_end - p0]
                self.sink_v[r, :, p0:s_end] = v[i, :, : s_end - p0]
            if not self.res_in_store:
                self.res_k[r, :, p0 - q0 : p0 - q0 + t] = k[i]
                self.res_v[r, :, p0 - q0 : p0 - q0 + t] = v[i]

    def write_fixed(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """update() of a fixed-shape pass (Step.fixed; the CUDA layout: residual buffers of their own, the
        store written as positions leave the window): every index from device tensors. k/v [b, H_kv, T, D]."""
        b = k.shape[0]
        rows = torch.arange(step.rows.start, step.rows.start + b, device=k.device)[:, None]  # [b, 1]
        pos = step.positions()  # [b, T]
        slot = pos - self.qend[step.rows][:, None]  # residual slot of each new token
        self.res_k[rows, :, slot] = k.transpose(1, 2)  # advanced dims first: [b, T, H_kv, D]
        self.res_v[rows, :, slot] = v.transpose(1, 2)
        s = self.sink_k.shape[2]  # a sink slot j takes the new token at position j, if there is one
        hit = (pos[:, :, None] == torch.arange(s, device=k.device)).to(k.dtype)  # [b, T, S]
        got = hit.sum(1) > 0  # [b, S]
        hit = hit.transpose(1, 2)[:, None]  # [b, 1, S, T]
        keep = ~got[:, None, :, None]
        self.sink_k[step.rows] = torch.where(keep, self.sink_k[step.rows], hit @ k)
        self.sink_v[step.rows] = torch.where(keep, self.sink_v[step.rows], hit @ v)

    @property
    def capturable(self) -> bool:
        """Decodes fixed-shape passes (Step.fixed): the CUDA layout (residual buffers of its own, the store
        written as positions leave the window), no hit count, and a fetch that gathers in place (on the compute
        stream, HostStore.gather_now, or the speculative prefetch's side stream, joined at the end of the
        pass; the corrected set at fixed size, host_memory.corrected_rows_fixed); a watched layer until its watch fires
        (engine/kvcache/watch.py: a recorded pass keeps its queries, the check runs after it; a fired watch
        attends exactly, eagerly)."""
        if self.res_in_store or self.store_on_update or self.config.measure_hits or (self.watch and self.watch.lost):
            return False
        return self.topk == 0 or self.store.can_gather_now()

    def boundaries(self, lengths: list[int] | torch.Tensor) -> list[int] | torch.Tensor:
        """Each row's quantized prefix for these lengths (what qend becomes after after_step; ints or [b] tensor)."""
        return quant_boundary(lengths, self.residual, self.group)

    def after_step(self, step: Step, new_q: list[int]) -> None:
        """After a pass is committed: quantize the groups that left the residual window (new_q: each
        row's boundary now, boundaries() of the committed lengths)."""
        for row in range(step.rows.start, step.rows.stop):
            old, new = self.qend_host[row], new_q[row]
            if new <= old:
                continue
            if self.res_in_store:
                k, v = self.store.read(row, old, new) if self.guide is not None else (None, None)
            else:  # the group's exact K/V are the residual buffer's slots [0, new - old): the store and the
                self.flush_to_store(row, new)  # guide take them from there (CUDA: nothing copied back from the host)
                k, v = self.res_k[row : row + 1, :, : new - old], self.res_v[row : row + 1, :, : new - old]
            if self.guide is not None:
                self.guide.add(row, old, k, v, self.recent_q)
            if not self.res_in_store:  # drop the quantized tokens from the residual buffer
                shift = new - old
                keep = self.res_k.shape[2] - shift
                self.res_k[row, :, :keep] = self.res_k[row, :, shift:].clone()
                self.res_v[row, :, :keep] = self.res_v[row, :, shift:].clone()
            self.qend[row] = new
            self.qend_host[row] = new

    def flush_to_store(self, row: int, upto: int) -> None:
        """Where the residual window has buffers of its own (CUDA) and the store is written as positions
        leave it (store_on_update False): copy row's committed positions [stored, upto) from the residual
        buffer into the host store, once each (after_step; a speculative fetch of a group about to leave)."""
        done = self.stored[row]
        if self.res_in_store or self.store is None or self.store_on_update or upto <= done:
            return
        q0 = self.qend_host[row]
        self.store.write_span(row, done, self.res_k[row, :, done - q0 : upto - q0],
                              self.res_v[row, :, done - q0 : upto - q0])
        self.stored[row] = upto

    # ---- the fetched set: hooks of a policy that fetches (topk > 0, engine/kvcache/policies/specache.py) --
    def select_current(self, scores, rscores, step: Step, nq: int, qend) -> None:
        """prefetch "current": pick this pass's own fetched set before it attends (nothing to pick here)."""

    def correct_fetched(self, scores, rscores, step: Step, nq: int, qend) -> None:
        """speculative with correct: the output token's own ranking corrects the prefetched set (nothing here)."""

    def select_and_prefetch(self, probs, step: Step, nq: int, n_res: int, qend, rpos) -> None:
        """Pick the next step's fetched set from this pass's attention and start fetching it (nothing here)."""

    def count_hits(self, qg, rscores, idx, step: Step, nq: int, scaling: float) -> None:
        """Measure the prefetch hit rate (nothing is fetched here)."""

    # ---- attention -----------------------------------------------------------------------
    def attend(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """q [b, H, T, D] -> [b, T, H, D]. See the module docstring (softcap: every score, exact or
        from the guide, is capped before the one softmax, as the model caps its own)."""
        if self.guide is not None and self.guide.auto:  # until its rotation is chosen: the last 32 tokens' queries
            self.recent_q = grouped_query(q[:1, :, -32:].float(), self.shape.kv_heads).clone()
        if step.prefill:
            return self.attend_prefill(q, scaling, step, softcap)
        return self.attend_decode(q, scaling, step, softcap)

    def attend_prefill(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """A prefill chunk of one row: exact attention over the row's exact prefix and the chunk.
        Past = the quantized prefix read from the exact store (sinks in window mode) + the residual
        positions before the chunk; on the CPU attended without a mask and merged with the chunk's
        causal block (split_prefill_attention), elsewhere one SDPA call with a shared mask."""
        row = step.rows.start
        start, t = step.starts[0], step.n_new
        qend = self.qend_host[row]
        if self.store is not None:
            k_past, v_past = self.store.read_prefix(row, qend)  # (a 16-bit store's elements: widened below)
        else:  # window mode keeps no store: sinks and the window are all there is
            k_past, v_past = self.sink_k[row : row + 1, :, : min(self.sinks, qend)], \
                self.sink_v[row : row + 1, :, : min(self.sinks, qend)]
        n_res = start + t - qend
        if split_attention_applies(q, step) and softcap is None:  # no mask: the past whole, the chunk's block causal
            recent = start - qend  # residual positions before the chunk
            rk, rv = self.residual_kv(step.rows, recent + t)
            out = None
            if step.compute == torch.bfloat16 and qend == k_past.shape[2]:  # the pieces tile [0, start + t)
                out = bf16_prefill_attention(q, [(k_past, v_past), (rk, rv)], scaling, start)
            if out is None:
                if self.store is not None and (self.res_in_store or self.store_on_update):  # it holds every
                    # committed position, the residual ones too (else they enter it as they leave the window): the past
                    # as one piece [0, start), as the full cache has it, so the same floats (a third merged part
                    # rounds otherwise, and a bf16 prefill's linears amplify that to 0.3 in the logits: exact /
                    # k >= context != full wherever the native bf16 kernel is missing)
                    past = [self.store.read_prefix(row, start)]
                else:  # the sinks (window mode) or the store's quantized prefix, and the residual positions before
                    # the chunk, as one piece
                    past = [(torch.cat([k_past.to(rk.dtype), rk[:, :, :recent]], dim=2),
                             torch.cat([v_past.to(rv.dtype), rv[:, :, :recent]], dim=2))]
                out = split_prefill_attention(q, past, rk[:, :, recent : recent + t], rv[:, :, recent : recent + t],
                                              scaling)
            return ungroup_output(out.to(q.dtype), self.shape.heads, t)
        qg = grouped_query(q, self.shape.kv_heads)
        rk, rv = self.residual_kv(step.rows, n_res)
        keys, values = torch.cat([k_past.to(rk.dtype), rk], dim=2), torch.cat([v_past.to(rv.dtype), rv], dim=2)
        past = keys.shape[2] - n_res

        def allowed() -> torch.Tensor:  # [1, 1, G*T, n]: the past all visible, the recent part causal
            cols = torch.arange(keys.shape[2], device=q.device)
            col_pos = torch.where(cols < past, cols, cols - past + qend)
            qpos = start + torch.arange(t, device=q.device)
            return (col_pos[None, :] <= qpos[:, None]).repeat(self.shape.group, 1)[None, None]

        mask = step.shared_value(("prefill", row, past, qend, n_res, self.shape.group, q.dtype),
                                 lambda: additive_mask(allowed(), q.dtype))
        out = masked_attention(qg, keys, values, mask, scaling, softcap)
        return ungroup_output(out, self.shape.heads, t)

    def attend_decode(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """One or two new tokens per row against guide + sinks + fetched set + residual (the device's
        backend's fused call where it applies, softcapped layers included); the torch steps below otherwise."""
        rows, t = step.rows, step.n_new
        if self.store is not None:  # the prefill is over: a held row's device copy goes (HostStore.read_prefix)
            self.store.release_prefix()
        qg = grouped_query(q, self.shape.kv_heads)  # [b, H_kv, G*T, D]
        exact_region = self.watch is not None and self.watched(qg, scaling, step, softcap)
        if not exact_region and fused_applies(self, q, step):  # one call of the device's backend
            self.fused = self.fused or fused_decode(self)
            out = self.fused(qg, scaling, step, softcap)
            if out is not None:  # (None: a kernel failed to launch, said once on stderr; the torch steps run)
                return ungroup_output(out.to(q.dtype), self.shape.heads, t)
        qend = self.qend[rows]  # [b]
        nq = max(self.qend_host[rows]) if self.use_guide else 0
        if step.fixed and self.use_guide:  # the guide's whole capacity, its columns past a row's qend masked
            nq = self.guide.keys.capacity
        scores = self.region_scores(qg, rows, nq, exact_region, scaling, softcap)  # [b, H_kv, GT, nq + 1]
        rk, rv, rscores, rpos = self.recent_scores(qg, step, qend, scaling, softcap)  # [b, H_kv, GT, n_res]
        cols = torch.arange(nq + 1, device=q.device)  # guide columns plus one trash column at nq
        out_of_rows = (cols[None, :] >= qend[:, None])[:, None, None, :]  # quantized columns beyond a row's qend
        idx, fv = self.fetched_scores(qg, scores, rscores, out_of_rows, step, nq, scaling, softcap)
        scores.masked_fill_(out_of_rows, NEG_INF)  # (and the trash column)
        probs = torch.softmax(torch.cat([scores, rscores], dim=-1), dim=-1)  # one softmax
        out = self.mixed_values(probs, rv, idx, fv, rows, nq, exact_region)
        if self.config.measure_hits and idx is not None and step.select != 0:
            self.count_hits(qg, rscores, idx, step, nq, scaling)
        if step.select is not None and self.topk:
            self.select_and_prefetch(probs, step, nq, rpos.shape[1], qend, rpos)
        return ungroup_output(out.to(q.dtype), self.shape.heads, t)

    def region_scores(self, qg: torch.Tensor, rows: slice, nq: int, exact_region: bool, scaling: float,
                      softcap: float | None) -> torch.Tensor:
        """Scores of the guide region [0, nq) plus a trash column at nq -> [b, H_kv, GT, nq + 1]: the guide's
        (the store's exact keys where the watch found the guide lost), exact at the sinks, softcapped."""
        b, h, gt = qg.shape[:3]
        scores = torch.full((b, h, gt, nq + 1), NEG_INF, dtype=torch.float32, device=qg.device)
        if nq and exact_region:  # the guide is lost (engine/kvcache/watch.py): the store's exact keys instead
            self.store.transfer.host_ready()  # (CUDA: the store's own copies done)
            keys = self.store.k[rows, :, :nq].to(qg.device).float()
            scores[..., :nq] = (qg.float() @ keys.transpose(-1, -2)) * scaling
        elif nq:
            scores[..., :nq] = self.guide.scores(qg.float(), rows, nq) * scaling
        s = min(self.sinks, nq)
        if s:  # exact scores where the sink is in the quantized region
            scores[..., :s] = (qg @ self.sink_k[rows, :, :s].transpose(-1, -2)).float() * scaling
        return soft_cap(scores, softcap)

    def recent_scores(self, qg: torch.Tensor, step: Step, qend: torch.Tensor, scaling: float,
                      softcap: float | None):
        """The residual window and the new tokens, exact and causal (qend: the rows' quantized prefixes [b]) ->
        (K, V [b, H_kv, n_res, D], scores [b, H_kv, GT, n_res], their absolute positions [b, n_res])."""
        rows, t, g = step.rows, step.n_new, self.shape.group
        n_res = self.res_k.shape[2] if step.fixed else max(p0 + t - q0 for p0, q0 in zip(step.starts,
                                                                                         self.qend_host[rows]))
        rk, rv = self.residual_kv(rows, n_res)
        rscores = soft_cap((qg @ rk.transpose(-1, -2)).float() * scaling, softcap)
        rpos = qend[:, None] + torch.arange(n_res, device=qg.device)
        visible = rpos[:, None, :] <= step.positions()[:, :, None]  # [b, T, n_res]
        rscores.masked_fill_(~visible.repeat(1, g, 1)[:, None], NEG_INF)
        return rk, rv, rscores, rpos

    def fetched_scores(self, qg, scores, rscores, out_of_rows, step: Step, nq: int, scaling: float,
                       softcap: float | None):
        """The fetched set (topk > 0: the specache policy, whose select_current / correct_fetched hooks are in
        engine/kvcache/policies/specache.py): picked now (prefetch current) or corrected, then its exact scores
        written over the guide's at its positions -> (its positions [b, H_kv, k] (invalid: the trash column
        nq), its exact V), or (None, None)."""
        if not (self.topk and nq):
            return None, None
        qend = self.qend[step.rows]
        if self.config.prefetch == "current":  # this pass picks its own set first
            self.select_current(scores.masked_fill(out_of_rows, NEG_INF), rscores, step, nq, qend)
        elif self.config.correct:  # speculative: the output token corrects the prefetched set
            self.correct_fetched(scores.masked_fill(out_of_rows, NEG_INF), rscores, step, nq, qend)
        fk, fv = self.store.fetched(step.rows)
        idx = torch.where(self.fvalid[step.rows], self.fidx[step.rows], nq)  # [b, H_kv, k]
        fscores = soft_cap((qg @ fk.transpose(-1, -2)).float() * scaling, softcap)  # [b, H_kv, GT, k]
        scores.scatter_(-1, idx[:, :, None, :].expand(-1, -1, qg.shape[2], -1), fscores)
        return idx, fv

    def mixed_values(self, probs, rv, idx, fv, rows: slice, nq: int, exact_region: bool) -> torch.Tensor:
        """The output [b, H_kv, GT, D] from one softmax's probabilities over [guide region + trash, recent]:
        exact values at the recent, sink and fetched positions, the guide's (or the store's, exact_region)
        for every other quantized position."""
        pg, pr = probs[..., : nq + 1], probs[..., nq + 1 :]
        out = (pr @ rv.float()) if rv.dtype != torch.float32 else pr @ rv
        s = min(self.sinks, nq)
        if s:
            out = out + pg[..., :s] @ self.sink_v[rows, :, :s].float()
        if idx is not None:
            fidx = idx[:, :, None, :].expand(-1, -1, pg.shape[2], -1)  # [b, H_kv, GT, k]
            out = out + torch.gather(pg, -1, fidx) @ fv.float()
        if nq:  # the guide serves every quantized position that is neither a sink nor fetched
            guide_p = pg.clone()
            guide_p[..., :s] = 0
            if idx is not None:
                guide_p.scatter_(-1, fidx, 0.0)  # invalid entries hit the trash column
            if exact_region:
                out = out + guide_p[..., :nq] @ self.store.v[rows, :, :nq].to(pg.device).float()
            else:
                out = out + self.guide.weighted_values(guide_p[..., :nq], rows, nq)
        return out

    def run_stats(self, layers: list["GuidedLayer"]) -> dict:
        """Settings for --json."""
        return {"bits": self.config.bits, "group": self.group, "k": self.topk, "residual": self.residual,
                "sinks": self.sinks, "rotation": self.config.guide_rotation if self.use_guide else None,
                "outliers": self.guide.outlier_count if self.use_guide else None,
                "guide_kernel": guide_kernel(self.sink_k.device) if self.use_guide else None, **unfused(type(self)),
                **({"rotated_layers": sum(x.guide.rotated for x in layers), "guided_layers": len(layers)}
                   if self.use_guide else {})}
