"""One forward pass of the model against cache rows (`forward`, its options `PassOptions`), the chunked prefill
of one row, and a device sync for the step loops' clocks (engine/generate/steps.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from engine.backends.streams import streams_for
from engine.kvcache import KVCache
from engine.model.linear_passes import prefill_pass
from engine.native import release_freed_memory


@dataclass(frozen=True)
class PassOptions:
    """How `forward` runs a pass against the cache rows: commit `keep` tokens and pick the positions to fetch
    from query `select` (KVCache.begin); the logits of the last `logits_to_keep` positions (0: none, a prefill
    chunk before the last: its lm_head, 262144 x 640 weights on Gemma 3, was a quarter of the prefill); a prefill chunk,
    an exact pass (exact mode's verification), a draft (a draft commit, KVCache.commit); commit=False: the
    caller commits, e.g. per row after a verification; fixed: a fixed-shape pass, Step.fixed."""

    keep: int | None = None
    select: int | None = None
    logits_to_keep: int = 1
    is_prefill: bool = False
    exact: bool = False
    draft: bool = False
    commit: bool = True
    fixed: bool = False


PLAIN = PassOptions()  # one pass, its tokens committed


@torch.inference_mode()
def forward(model, cache: KVCache, ids: torch.Tensor, rows: slice, how: PassOptions = PLAIN) -> torch.Tensor:
    """Run ids [b, T] through the model against the cache rows, as `how` says. -> logits [b, n, V]."""
    step = cache.begin(rows, ids.shape[1], how.keep, how.select, how.is_prefill, how.exact, how.draft, how.fixed)
    keep = how.logits_to_keep or torch.empty(0, dtype=torch.long, device=ids.device)  # no positions (transformers' 0 is all)
    out = model(input_ids=ids, position_ids=step.positions(), cache=cache, use_cache=True,
                kv_cache=cache, logits_to_keep=keep)
    if how.commit:
        cache.commit(draft=how.draft)
    return out.logits


def prefill(model, cache: KVCache, prompt: list[int], row: int, chunk_size: int) -> Iterator[int | torch.Tensor]:
    """Feed one row's prompt in chunks; yields the tokens done after each chunk, then the last logits [V]."""
    device = cache.lengths.device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
    logits = None
    for s in range(0, len(prompt), chunk_size):
        last = s + chunk_size >= len(prompt)
        with prefill_pass():  # the chunk's linears may compute in the model's prefill dtype (bf16)
            logits = forward(model, cache, ids[:, s : s + chunk_size], slice(row, row + 1),
                             how=PassOptions(logits_to_keep=int(last), is_prefill=True))
        if device.type == "cpu":  # the chunk's transients, freed, back to the system (else they stay resident)
            release_freed_memory()
        yield min(s + chunk_size, len(prompt))
    yield logits[0, -1]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (its streams': CUDA's; nothing on the CPU), so that a clock reading
    means something."""
    streams_for(device).synchronize()
