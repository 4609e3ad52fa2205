"""The step loops, as small free functions over (model, cache): the decoders of the cache modes (gpt-fast
style; engine.generate.engine.Engine drives them), over a forward pass and the chunked prefill of one row
(engine/generate/forward.py) and the batch rows' bookkeeping (engine/generate/rows.py).

    plain_steps:        one token per step (full, kivi, window, and specache with prefetch "current")
    speculative_steps:  SpeCache, pre-decoding then two tokens per step [T_t, T'_{t+1}]: the output
                        token, attending with the exact K/V fetched for it, and a speculative token whose
                        attention row picks (per layer, per KV head) the positions to fetch next
    exact_steps:        exact mode, gamma guided draft steps then one exact verification pass per cycle
                        (engine/generate/exact_steps.py)
"""
from __future__ import annotations

from typing import Iterator

import torch

from engine.config import GAMMA_MAX
from engine.generate.exact_steps import (
    GammaChooser,
    _accept,
    _draft,
    draft_logits,
    exact_cycles,
    exact_stats,
    exact_steps,
    merge_exact_stats,
)
from engine.generate.forward import PLAIN, PassOptions, forward, prefill, sync
from engine.generate.graphs import DecodeGraphs, graphs_wanted
from engine.generate.rows import Picker, _append, _histories, _keep, _per_row, drop_finished, greedy
from engine.generate.sampling import argmax_ids
from engine.kvcache import KVCache

__all__ = ["PLAIN", "PassOptions", "forward", "prefill", "sync", "Picker", "greedy", "drop_finished", "plain_steps",
           "speculative_steps", "exact_cycles", "exact_steps", "exact_stats", "merge_exact_stats", "GammaChooser",
           "draft_logits", "_draft", "_accept", "decoder_for", "decode_headroom"]


def plain_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker, history: list[list[int]] | None = None,
                finished: list[bool] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One token per step. logits [B, V] are the prefill's last logits. Yields (ids [B], the logits they
    came from). finished: the caller's live list of rows it no longer needs (read after each yield):
    such a row leaves the batch (drop_finished) and gets id -1 and zero logits; the loop ends when
    every row has."""
    batch = cache.batch
    hist = _histories(history, batch)
    slots = list(range(batch))  # the caller's row held by each cache slot [0, n)
    graphs = DecodeGraphs(model, cache, forward) if graphs_wanted(cache) else None  # replayed passes (CUDA)
    while True:
        ids = pick(logits, hist)
        _append(hist, ids)
        yield _per_row(ids, slots, batch, -1), _per_row(logits, slots, batch, 0.0)
        source = drop_finished(cache, slots, finished, pick)
        if len(source) < len(slots):
            slots, hist, ids = _keep(source, slots, hist, ids)
        if not slots:
            return
        logits = (graphs(ids[:, None]) if graphs is not None else
                  forward(model, cache, ids[:, None], slice(0, len(slots))))[:, -1]


def speculative_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker,
                      history: list[list[int]] | None = None,
                      finished: list[bool] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """SpeCache decoding (the paper's Algorithms 2 and 3; docs/algorithm.md). Yields (output ids [B], their logits)
    per step.

    history: each row's tokens so far (its prompt). With it and cache.config.resync, a missed
    speculation is re-synced: the speculative token of step t+1 comes from the speculative token
    of step t, so after one wrong guess the next guesses are conditioned on a wrong token; when
    the fed guess differs from the output token the step produced, the next guess is instead the
    token that followed the latest earlier occurrence of that output token in the row (prompt
    lookup; documents are copied from a lot). Which positions are fetched changes, never
    correctness. finished: as in plain_steps (a row that leaves takes its fetched set along)."""
    batch = cache.batch
    hist = _histories(history, batch)
    slots = list(range(batch))
    out = pick(logits, hist)  # T1
    _append(hist, out)
    yield out, logits
    resync = history is not None and cache.config.resync
    follow = [_follow_table(h) for h in history] if resync else None
    prev = [h[-1] if h else None for h in history] if resync else None
    if finished and all(finished):
        return
    # Pre-decoding: T1 alone against guide + residual; its row picks the first fetch set, its
    # logits give the first speculative token. Nothing is kept: T1 is fed again, exactly, next.
    spec = argmax_ids(forward(model, cache, out[:, None], slice(0, batch), how=PassOptions(keep=0, select=0))[:, -1])
    graphs = DecodeGraphs(model, cache, forward) if graphs_wanted(cache) else None  # replayed passes (CUDA)
    while True:
        source = drop_finished(cache, slots, finished, pick)
        if len(source) < len(slots):
            slots, hist, out, spec = _keep(source, slots, hist, out, spec)
            if follow is not None:
                follow, prev = _keep(source, follow, prev)
        if not slots:
            return
        pair = torch.stack([out, spec], dim=1)  # [n, 2] = [T_t, T'_{t+1}]
        both = (graphs(pair, keep=1, select=1, logits_to_keep=2) if graphs is not None else  # [n, 2, V]
                forward(model, cache, pair, slice(0, len(slots)),
                        how=PassOptions(keep=1, select=1, logits_to_keep=2)))
        fed = pair[:, 1]
        out = pick(both[:, 0], hist)
        spec = argmax_ids(both[:, 1])
        if follow is not None:  # the output tokens read with the re-sync's vectors: one host sync a step
            spec, ids = _resync(follow, prev, pair[:, 0], out, fed, spec)
            _append(hist, ids)
        else:
            _append(hist, out)
        yield _per_row(out, slots, batch, -1), _per_row(both[:, 0], slots, batch, 0.0)


def _follow_table(tokens: list[int]) -> dict[int, int]:
    """token -> the token after its latest occurrence."""
    return {a: b for a, b in zip(tokens, tokens[1:])}


def _resync(follow, prev, current: torch.Tensor, out: torch.Tensor, fed: torch.Tensor,
            spec: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Record the committed tokens and replace the guesses that followed a missed one (see speculative_steps).
    -> (the next guesses, the output tokens as read on the host: the step's one read of device values)."""
    cur, nxt, guessed, new = torch.stack([current, out, fed, spec]).long().tolist()  # one host read, not four
    for r in range(len(cur)):
        if prev[r] is not None:
            follow[r][prev[r]] = cur[r]
        prev[r] = cur[r]
        if guessed[r] != nxt[r]:
            following = nxt[r] if cur[r] == nxt[r] else follow[r].get(nxt[r])
            if following is not None:
                new[r] = following
    return torch.tensor(new, dtype=spec.dtype, device=spec.device), nxt


def decoder_for(cache: KVCache):
    """The step loop of a cache's policy: exact's draft-and-verify cycles when it verifies,
    speculative when it speculates (specache with k > 0 and prefetch "speculative"), plain otherwise
    (one token per step)."""
    if cache.policy.verifies:
        return exact_steps
    return speculative_steps if cache.policy.speculates(cache.config) else plain_steps


def decode_headroom(policy: type) -> int:
    """Cache tokens a decode loop needs beyond the tokens it emits: exact mode's last cycle may
    commit GAMMA_MAX + 1 tokens past a row's end (a finished row leaves the batch: drop_finished)."""
    return GAMMA_MAX + 1 if policy.verifies else 0
