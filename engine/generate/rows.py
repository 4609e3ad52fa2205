"""The step loops' bookkeeping of batch rows (engine/generate/steps.py): the picker type, each row's tokens
so far, per-slot values at the caller's rows, and finished rows leaving the batch (drop_finished)."""
from __future__ import annotations

from typing import Callable

import torch

from engine.generate.sampling import Sampler, argmax_ids
from engine.kvcache import KVCache

Picker = Callable[[torch.Tensor, list[list[int]]], torch.Tensor]  # (logits [B, V], each row's tokens) -> ids [B]


def greedy(logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
    """The argmax picker (benches, tests)."""
    return argmax_ids(logits)


def _histories(history: list[list[int]] | None, batch: int) -> list[list[int]]:
    """Each row's tokens so far, copied (the step loops append their outputs for the picker)."""
    return [list(h) for h in history] if history is not None else [[] for _ in range(batch)]


def _append(hist: list[list[int]], ids: torch.Tensor | list[int]) -> None:
    """Each row's new token onto its history (ids on the device: read on the host here, a host sync)."""
    for h, t in zip(hist, ids.tolist() if isinstance(ids, torch.Tensor) else ids):
        h.append(t)


def _per_row(x: torch.Tensor, slots: list[int], batch: int, fill: float) -> torch.Tensor:
    """Values of the live slots x [n, ...] at their caller rows, `fill` at rows that left. -> [batch, ...]"""
    if len(slots) == batch:
        return x
    out = x.new_full((batch, *x.shape[1:]), fill)
    return out.index_copy_(0, torch.tensor(slots, device=x.device), x)


def _keep(source: list[int], *per_slot):
    """Each per-slot value (a list, or a tensor with slots first) reduced to the slots kept by
    drop_finished, in their new order."""
    return tuple(v[source] if isinstance(v, torch.Tensor) else [v[s] for s in source] for v in per_slot)


def drop_finished(cache: KVCache, slots: list[int], finished: list[bool] | None, pick: Picker | None = None
                  ) -> list[int]:
    """Rows the caller finished leave the batch: the state of a live row beyond the new end moves into
    each freed slot (KVCache.copy_row), so the live rows stay one slice [0, n) and no pass computes a
    finished row; a Sampler `pick` renumbers its rows alike. slots: the caller's row held by each
    slot. -> for each slot kept, the slot it came from."""
    n = len(slots)
    if not finished or not any(finished[r] for r in slots):
        return list(range(n))
    live = [s for s in range(n) if not finished[slots[s]]]
    keep = len(live)
    source = list(range(keep))
    movers = iter(s for s in live if s >= keep)  # live slots past the new end fill the freed slots before it
    for dst in range(keep):
        if finished[slots[dst]]:
            source[dst] = next(movers)
            cache.copy_row(source[dst], dst)
    if isinstance(pick, Sampler):
        pick.keep_rows(source)
    return source
