"""The step loops, as small free functions over (model, cache): a forward pass, chunked prefill of
one row, and the decoders of the cache modes (gpt-fast style; engine.generate.engine.Engine drives them).

    plain_steps:        one token per step (full, kivi, window, and specache with prefetch "current")
    speculative_steps:  SpeCache, pre-decoding then two tokens per step [T_t, T'_{t+1}]: the output
                        token, attending with the exact K/V fetched for it, and a speculative token whose
                        attention row picks (per layer, per KV head) the positions to fetch next
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from engine.config import CacheConfig
from engine.kvcache import POLICIES, KVCache


@torch.inference_mode()
def forward(model, cache: KVCache, ids: torch.Tensor, rows: slice, keep: int | None = None,
            select: int | None = None, logits_to_keep: int = 1, is_prefill: bool = False) -> torch.Tensor:
    """Run ids [b, T] through the model against the cache rows; commit `keep` tokens. -> logits [b, n, V]."""
    step = cache.begin(rows, ids.shape[1], keep, select, is_prefill)
    out = model(input_ids=ids, position_ids=step.positions(), cache=cache, use_cache=True,
                kv_cache=cache, logits_to_keep=logits_to_keep)
    cache.commit()
    return out.logits


def prefill(model, cache: KVCache, prompt: list[int], row: int, chunk_size: int) -> Iterator[int | torch.Tensor]:
    """Feed one row's prompt in chunks; yields the tokens done after each chunk, then the last logits [V]."""
    device = cache.lengths.device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
    logits = None
    for s in range(0, len(prompt), chunk_size):
        logits = forward(model, cache, ids[:, s : s + chunk_size], slice(row, row + 1), is_prefill=True)
        yield min(s + chunk_size, len(prompt))
    yield logits[0, -1]


Picker = Callable[[torch.Tensor, list[list[int]]], torch.Tensor]  # (logits [B, V], each row's tokens) -> ids [B]


def greedy(logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
    """The argmax picker (benches, tests)."""
    return logits.argmax(-1)


def _histories(history: list[list[int]] | None, batch: int) -> list[list[int]]:
    """Each row's tokens so far, copied (the step loops append their outputs for the picker)."""
    return [list(h) for h in history] if history is not None else [[] for _ in range(batch)]


def _append(hist: list[list[int]], ids: torch.Tensor) -> None:
    for h, t in zip(hist, ids.tolist()):
        h.append(t)


def plain_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker,
                history: list[list[int]] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One token per step. logits [B, V] are the prefill's last logits. Yields (ids [B], the logits they came from)."""
    rows = slice(0, cache.batch)
    hist = _histories(history, cache.batch)
    while True:
        ids = pick(logits, hist)
        _append(hist, ids)
        yield ids, logits
        logits = forward(model, cache, ids[:, None], rows)[:, -1]


def speculative_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker,
                      history: list[list[int]] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """SpeCache decoding (design page, Algorithms 2 and 3). Yields (output ids [B], their logits) per step.

    history: each row's tokens so far (its prompt). With it and cache.config.resync, a missed
    speculation is re-synced: the speculative token of step t+1 comes from the speculative token
    of step t, so after one wrong guess the next guesses are conditioned on a wrong token; when
    the fed guess differs from the output token the step produced, the next guess is instead the
    token that followed the latest earlier occurrence of that output token in the row (prompt
    lookup; documents are copied from a lot). Which positions are fetched changes, never
    correctness."""
    rows = slice(0, cache.batch)
    hist = _histories(history, cache.batch)
    out = pick(logits, hist)  # T1
    _append(hist, out)
    yield out, logits
    resync = history is not None and cache.config.resync
    follow = [_follow_table(h) for h in history] if resync else None
    prev = [h[-1] if h else None for h in history] if resync else None
    # Pre-decoding: T1 alone against guide + residual; its row picks the first fetch set, its
    # logits give the first speculative token. Nothing is kept: T1 is fed again, exactly, next.
    spec = forward(model, cache, out[:, None], rows, keep=0, select=0)[:, -1].argmax(-1)
    while True:
        pair = torch.stack([out, spec], dim=1)  # [B, 2] = [T_t, T'_{t+1}]
        both = forward(model, cache, pair, rows, keep=1, select=1, logits_to_keep=2)  # [B, 2, V]
        fed = pair[:, 1]
        out = pick(both[:, 0], hist)
        _append(hist, out)
        spec = both[:, 1].argmax(-1)
        if follow is not None:
            spec = _resync(follow, prev, pair[:, 0], out, fed, spec)
        yield out, both[:, 0]


def _follow_table(tokens: list[int]) -> dict[int, int]:
    """token -> the token after its latest occurrence."""
    return {a: b for a, b in zip(tokens, tokens[1:])}


def _resync(follow, prev, current: torch.Tensor, out: torch.Tensor, fed: torch.Tensor,
            spec: torch.Tensor) -> torch.Tensor:
    """Record the committed tokens and replace the guesses that followed a missed one (see speculative_steps)."""
    cur, nxt, guessed, new = current.tolist(), out.tolist(), fed.tolist(), spec.tolist()
    for r in range(len(cur)):
        if prev[r] is not None:
            follow[r][prev[r]] = cur[r]
        prev[r] = cur[r]
        if guessed[r] != nxt[r]:
            following = nxt[r] if cur[r] == nxt[r] else follow[r].get(nxt[r])
            if following is not None:
                new[r] = following
    return torch.tensor(new, dtype=spec.dtype, device=spec.device)


def decoder_for(config: CacheConfig):
    """The step loop of a cache mode: speculative when its policy speculates (specache with k > 0 and
    prefetch "speculative"), plain otherwise (one token per step)."""
    return speculative_steps if POLICIES[config.mode].speculates(config) else plain_steps
