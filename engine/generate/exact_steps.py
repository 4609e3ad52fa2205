"""Exact mode's decode loop (engine/kvcache/policies/exact.py): the guided cache drafts gamma tokens, one exact
pass verifies them (engine/generate/steps.py picks it: decoder_for)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.config import GAMMA_MAX
from engine.generate.forward import PassOptions, forward, sync
from engine.generate.rows import Picker, _append, _histories, _keep, _per_row, drop_finished
from engine.generate.sampling import Sampler, argmax_ids
from engine.kvcache import KVCache
from engine.kvcache.policies.exact import expected_tokens
from engine.model.linear_passes import row_invariant

# exact mode's pass costs when they are not timed (GammaChooser.timed), relative to a verification
# of one token: a draft pass, and what each further verified token adds (measured: docs/results.md, "Exact mode")
UNTIMED_DRAFT = 0.5
UNTIMED_VERIFY_SLOPE = 0.1


@dataclass
class GammaChooser:
    """Draft tokens per cycle: `fixed`, or the gamma in 1..GAMMA_MAX that maximises the expected
    tokens per second of a row, (1 - a^(g+1)) / (1 - a) tokens per g draft passes + one verify of
    g + 1 tokens, from decayed measurements: the acceptance a (accepted drafts / (accepted +
    rejections): a row's accepted run is geometric in a), the seconds of a draft pass, and the
    seconds of a verification per number of tokens fed (verify_seconds)."""

    fixed: int | None = None
    timed: bool = True  # False: the pass costs are the fixed ratio below, not timings (sampling: a seed
    # must reproduce its output, and the random draws depend on gamma)
    start: int = 4  # until both passes were timed
    decay: float = 0.9  # weight of the older measurements, per cycle
    accepted: float = 1.4  # pseudo-counts: a prior acceptance of 0.7
    rejected: float = 0.6
    draft_s: float | None = None
    verify: dict = field(default_factory=dict)  # tokens fed -> [decayed weight, decayed sum of seconds]

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    def verify_seconds(self, tokens: int) -> float:
        """Verify time for `tokens` tokens per row: the decayed mean at that size when seen, else
        linear between the nearest sizes seen, past the largest along the slope of the last two
        (flat when one size was seen, so that a longer draft gets tried), below the smallest its
        time. (A straight-line fit through all sizes extrapolated below zero: the cost is not a
        line, e.g. the linears run 8 rows per native call, and past 64 rows torch's GEMM.)"""
        seen = sorted((t, y / w) for t, (w, y) in self.verify.items())
        below = [p for p in seen if p[0] <= tokens]
        above = [p for p in seen if p[0] >= tokens]
        if below and above:
            (t0, y0), (t1, y1) = below[-1], above[0]
            return y0 if t1 == t0 else y0 + (y1 - y0) * (tokens - t0) / (t1 - t0)
        if below:  # past the largest size seen: the slope of the last two sizes (flat with one: explore)
            (t0, y0), (t1, y1) = seen[-2] if len(seen) > 1 else seen[-1], seen[-1]
            return y1 + max(0.0, (y1 - y0) / (t1 - t0) if t1 > t0 else 0.0) * (tokens - t1)
        return above[0][1]

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.draft_s is None or not self.verify:
            return self.start
        return max(range(1, GAMMA_MAX + 1), key=self.tokens_per_second)

    def tokens_per_second(self, gamma: int) -> float:
        a = min(self.acceptance, 1 - 1e-9)
        return expected_tokens(a, gamma) / (gamma * self.draft_s + self.verify_seconds(gamma + 1))

    def record(self, accepted: int, rejected: int, gamma: int, draft_s: float | None, verify_s: float | None) -> None:
        """One cycle: accepted draft tokens and rejections over its active rows, its pass times
        (None: not timed, e.g. the first cycle, which pays one-time costs)."""
        if not self.timed:
            draft_s, verify_s = gamma * UNTIMED_DRAFT, 1 + UNTIMED_VERIFY_SLOPE * gamma
        d = self.decay
        self.accepted, self.rejected = d * self.accepted + accepted, d * self.rejected + rejected
        if draft_s is None or verify_s is None:
            return
        if gamma:
            per = draft_s / gamma
            self.draft_s = per if self.draft_s is None else d * self.draft_s + (1 - d) * per
        for entry in self.verify.values():
            entry[0], entry[1] = d * entry[0], d * entry[1]
        entry = self.verify.setdefault(gamma + 1, [0.0, 0.0])
        entry[0], entry[1] = entry[0] + 1.0, entry[1] + verify_s


def draft_logits(model, cache: KVCache, ids: torch.Tensor, rows: slice) -> torch.Tensor:
    """One draft pass: ids [b, 1] through the guided attention, committed as a draft (the lengths
    move, nothing is quantized). -> next-token logits [b, V]"""
    return forward(model, cache, ids, rows, how=PassOptions(draft=True))[:, -1]


def _draft(model, cache: KVCache, t0: torch.Tensor, gamma: int, hist: list[list[int]],
           sampler: Sampler | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gamma draft tokens per row from the pending tokens t0 [B]: argmax of the draft logits, or
    with a Sampler a draw from its processed draft distribution q. -> (drafts [B, gamma], q [B, gamma, V] or None)"""
    rows = slice(0, t0.shape[0])
    x, drafts, qs = t0, [], []
    dh = [list(h) for h in hist] if sampler is not None else None
    for _ in range(gamma):
        logits = draft_logits(model, cache, x[:, None], rows)
        if sampler is None:
            x = argmax_ids(logits)
        else:
            q = sampler.probs(logits, dh)
            x = argmax_ids(q) if sampler.greedy else sampler.draw(q)
            qs.append(q)
            _append(dh, x)
        drafts.append(x)
    empty = t0.new_zeros(t0.shape[0], 0)
    return (torch.stack(drafts, 1) if drafts else empty), (torch.stack(qs, 1) if qs else None)


def _accept(pick: Picker, out: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
            hist: list[list[int]]) -> tuple[list[int], list[int]]:
    """Verification of drafts [B, g] against the exact logits out [B, g + 1, V]. -> (accepted drafts
    per row, the row's next token: the exact choice at the first rejection, or after the last draft).

    A plain picker (greedy, a teacher-forced sequence) or a greedy Sampler: the picker chooses at
    positions 0, 1, ... with the drafts so far in the history; a draft is accepted while it is what
    the picker chose (so the output is the picker's over exact logits). A sampling Sampler (q: the
    drafts' distributions after the same processing): the speculative sampling rule, accept draft i
    with probability min(1, p/q), else draw from max(0, p - q) normalised; the output is
    distributed as draws from p alone."""
    b, g = drafts.shape
    dl = drafts.tolist()
    sampling = isinstance(pick, Sampler) and not pick.greedy and q is not None
    n_acc, new, still = [0] * b, [0] * b, [True] * b
    ph = [list(h) for h in hist]
    for i in range(g + 1):
        if not any(still):
            break
        if not sampling:
            chosen, ok = pick(out[:, i], ph).tolist(), None
        else:
            p = pick.probs(out[:, i], ph)
            if i == g:
                chosen, ok = pick.draw(p).tolist(), None
            else:
                d = drafts[:, i : i + 1]
                ratio = (p.gather(1, d) / q[:, i].gather(1, d).clamp(min=1e-30)).clamp(max=1.0)  # [B, 1]
                ok = pick.draw(torch.cat([1 - ratio, ratio], 1)).tolist()  # 1: accepted
                rest = (p - q[:, i]).clamp(min=0)
                norm = rest.sum(-1, keepdim=True)
                chosen = pick.draw(torch.where(norm > 0, rest / norm.clamp(min=1e-30), p)).tolist()
        for r in range(b):
            if not still[r]:
                continue
            accepted = i < g and (chosen[r] == dl[r][i] if ok is None else ok[r] == 1)
            if accepted:
                n_acc[r] += 1
            else:
                new[r], still[r] = chosen[r], False
        if i < g:
            _append(ph, drafts[:, i])
    return n_acc, new


def _cycle(model, cache: KVCache, pick: Picker, t0: torch.Tensor, gamma: int, hist: list[list[int]],
           sampler: Sampler | None) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor, float, float]:
    """One cycle of exact_cycles over the live rows [0, n) (n = len(t0)): gamma draft passes, rollback, one
    exact pass over [t0, drafts], the acceptance, the commit per row. -> (accepted drafts per row, each row's
    next token, drafts [n, gamma], the exact logits [n, gamma + 1, V], draft seconds, verify seconds)."""
    rows, dev = slice(0, t0.shape[0]), cache.lengths.device
    committed = cache.lengths[rows].clone()
    sync(dev)
    t_start = time.perf_counter()
    with row_invariant():  # drafts and the verification: each row's linears as a one-row step's
        drafts, q = _draft(model, cache, t0, gamma, hist, sampler)
        cache.rollback(rows, committed)
        sync(dev)
        t_drafted = time.perf_counter()
        out = forward(model, cache, torch.cat([t0[:, None], drafts], 1), rows,
                      how=PassOptions(logits_to_keep=gamma + 1, exact=True, commit=False))  # committed per row below
    n_acc, new = _accept(pick, out, drafts, q, hist)
    cache.commit(kept=torch.tensor([a + 1 for a in n_acc], dtype=torch.long))
    sync(dev)
    t_verified = time.perf_counter()
    return n_acc, new, drafts, out, t_drafted - t_start, t_verified - t_drafted


def _record(chooser: GammaChooser, totals: dict, n_acc: list[int], gamma: int, draft_s: float,
            verify_s: float) -> None:
    """A cycle's figures into the chooser and the running totals (exact_stats)."""
    n, acc = len(n_acc), sum(n_acc)
    rejected = sum(1 for a in n_acc if a < gamma)
    warm = totals["verifies"] > 0  # the first cycle builds kernels' state and warms caches: not timed
    chooser.record(acc, rejected, gamma, draft_s if warm else None, verify_s if warm else None)
    for key, value in (("drafted", gamma * n), ("accepted", acc), ("row_cycles", n),
                       ("tokens", acc + n), ("verifies", 1), ("gamma_sum", gamma),
                       ("draft_s", draft_s), ("draft_passes", gamma), ("verify_s", verify_s)):
        totals[key] += value


def exact_cycles(model, cache: KVCache, logits: torch.Tensor, pick: Picker, history: list[list[int]] | None = None,
                 finished: list[bool] | None = None) -> Iterator[tuple[list[list[int]], torch.Tensor]]:
    """Exact mode's decode loop, a cycle at a time. Yields (each row's new tokens, the exact logits
    [B, n, V] they came from, position j for token j): first the token from the prefill's logits,
    then per cycle the accepted drafts and one token of the exact distribution.

    A cycle: from each row's pending token t0 (chosen, not yet fed), gamma draft passes with the
    guided attention; rollback; one exact pass over [t0, drafts] (Step.exact); accept (_accept);
    commit t0 and the accepted drafts per row. finished: the caller's live list of rows it no
    longer needs (read before each cycle): such a row leaves the batch (drop_finished), gets no
    tokens and zero logits; the loop ends when every row has. Measured figures go to cache.decode_stats."""
    batch = cache.batch
    hist = _histories(history, batch)
    sampler = pick if isinstance(pick, Sampler) else None
    t0 = pick(logits, hist)
    _append(hist, t0)
    yield [[t] for t in t0.tolist()], logits[:, None]
    chooser = GammaChooser(cache.config.gamma, timed=sampler is None or sampler.greedy)
    totals = {"drafted": 0, "accepted": 0, "row_cycles": 0, "tokens": 0, "verifies": 0, "gamma_sum": 0,
              "draft_s": 0.0, "draft_passes": 0, "verify_s": 0.0}
    slots = list(range(batch))  # the caller's row held by each cache slot [0, n)
    while True:
        source = drop_finished(cache, slots, finished, pick)
        if len(source) < len(slots):
            slots, hist, t0 = _keep(source, slots, hist, t0)
        n = len(slots)
        if n == 0:
            return
        room = cache.max_len - int(cache.lengths[:n].max()) - 1
        if room < 0:
            raise RuntimeError(f"cache overflow: exact mode needs room for one more token of {cache.max_len}")
        gamma = min(chooser.choose(), room)
        n_acc, new, drafts, out, draft_s, verify_s = _cycle(model, cache, pick, t0, gamma, hist, sampler)
        dl = drafts.tolist()
        emitted_slots = [dl[i][: n_acc[i]] + [new[i]] for i in range(n)]
        for h, e in zip(hist, emitted_slots):
            h.extend(e)
        _record(chooser, totals, n_acc, gamma, draft_s, verify_s)
        cache.decode_stats = exact_stats(totals, cache.config.gamma)
        t0 = torch.tensor(new, dtype=t0.dtype, device=t0.device)
        emitted: list[list[int]] = [[] for _ in range(batch)]
        for i, r in enumerate(slots):
            emitted[r] = emitted_slots[i]
        yield emitted, _per_row(out, slots, batch, 0.0)  # zeros for the rows that left


def exact_stats(totals: dict, gamma: int | None) -> dict:
    """exact mode's --json figures: acceptance_rate = accepted drafts / drafted, tokens_per_verify =
    tokens per row per verification, mean gamma and the mean seconds of a draft pass / a verification;
    with the counts (drafted, accepted, row_verifications) that merge_exact_stats adds up."""
    n = max(totals["verifies"], 1)
    return {"gamma": gamma if gamma is not None else "auto",
            "gamma_mean": round(totals["gamma_sum"] / n, 3),
            "acceptance_rate": round(totals["accepted"] / totals["drafted"], 4) if totals["drafted"] else None,
            "tokens_per_verify": round(totals["tokens"] / max(totals["row_cycles"], 1), 3),
            "verifies": totals["verifies"],
            "draft_pass_ms": round(1000 * totals["draft_s"] / max(totals["draft_passes"], 1), 3),
            "verify_ms": round(1000 * totals["verify_s"] / n, 3),
            "drafted": totals["drafted"], "accepted": totals["accepted"], "row_verifications": totals["row_cycles"]}


def merge_exact_stats(a: dict, b: dict) -> dict:
    """Cache stats of two model calls of one job (map-reduce sections): b's, with exact mode's
    figures over both calls (counts added, means weighted by their counts)."""
    if "verifies" not in a or "verifies" not in b:
        return b

    def totals(x: dict) -> dict:
        passes = x["gamma_mean"] * x["verifies"]
        return {"drafted": x["drafted"], "accepted": x["accepted"], "row_cycles": x["row_verifications"],
                "tokens": x["accepted"] + x["row_verifications"], "verifies": x["verifies"], "gamma_sum": passes,
                "draft_s": x["draft_pass_ms"] * passes / 1000, "draft_passes": passes,
                "verify_s": x["verify_ms"] * x["verifies"] / 1000}

    ta, tb = totals(a), totals(b)
    merged = exact_stats({k: ta[k] + tb[k] for k in ta}, b["gamma"] if b["gamma"] != "auto" else None)
    return {**b, **merged}


def exact_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker, history: list[list[int]] | None = None,
                finished: list[bool] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """exact_cycles one token per row per yield, like the other step loops: (ids [B], their logits
    [B, V]); a row with fewer new tokens in a cycle than another gets -1 (no token) at the yields
    it has none."""
    for emitted, out in exact_cycles(model, cache, logits, pick, history, finished):
        n = max(map(len, emitted))
        if n == 0:
            return
        for j in range(n):
            ids = torch.tensor([e[j] if j < len(e) else -1 for e in emitted], device=out.device)
            yield ids, out[:, min(j, out.shape[1] - 1)]
