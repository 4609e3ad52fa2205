"""Next-token choice: greedy, temperature and nucleus (top-p) sampling."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row. logits [B, V] -> ids [B] (long). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches top_p, renormalised. [B, V] -> [B, V]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    drop = (cum - sorted_p) >= top_p  # keep the token that crosses top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)
