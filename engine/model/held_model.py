"""The model around its held weights: `HeldEmbedding`, the embedding that rebuilds the rows of the tokens it
looks up from a held weight, and what a model's weights take as held (held_bytes, held_parameters).
"""
from __future__ import annotations

import torch


class HeldEmbedding(torch.nn.Module):
    """nn.Embedding over a held weight [V, D] (the GGUF's blocks, often shared with a tied lm_head):
    the rows of the looked-up tokens are rebuilt in fp32, bit for bit, on each lookup."""

    def __init__(self, held, padding_idx: int | None = None):
        super().__init__()
        self.held, self.padding_idx = held, padding_idx
        self.num_embeddings, self.embedding_dim = held.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() == 1:  # a decode step's token
            i = int(ids.reshape(()))
            return self.held.rows(i, i + 1).reshape(*ids.shape, self.embedding_dim).to(ids.device)
        uniq, inverse = torch.unique(ids.reshape(-1).cpu(), return_inverse=True)
        table = torch.cat([self.held.rows(int(i), int(i) + 1) for i in uniq.tolist()])
        return table[inverse].reshape(*ids.shape, self.embedding_dim).to(ids.device)


def held_bytes(model: torch.nn.Module) -> dict:
    """The model's weights as held in memory, by format: {"total": bytes, "by_format": {kind: bytes}}
    (parameters, packed and block weights; a linear's packed copy beside its fp32 weight counts too).
    Tied weights (one held object for the embedding and the lm_head) count once."""
    seen: set[int] = set()
    by: dict[str, int] = {}

    def add(kind: str, obj, nbytes: int) -> None:
        if id(obj) not in seen:
            seen.add(id(obj))
            by[kind] = by.get(kind, 0) + nbytes

    for p in model.parameters():
        if p.device.type != "meta":
            add(str(p.dtype).removeprefix("torch."), p, p.numel() * p.element_size())
    for m in model.modules():
        for held in (getattr(m, "held", None), getattr(m, "packed", None)):
            if held is not None:
                add(held.kind, held, held.nbytes)
    return {"total": sum(by.values()), "by_format": by}


def held_parameters(model: torch.nn.Module) -> int:
    """Weights the model computes with (parameters and held weights, tied ones once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        seen.add(id(p))
        total += p.numel()
    for m in model.modules():
        held = getattr(m, "held", None)
        if held is not None and id(held) not in seen:
            seen.add(id(held))
            total += held.shape[0] * held.shape[1]
    return total
