"""Orthogonal transforms of the guide (issue 26, bench-results/guide-study-findings.md): a guide
built from K R and V R instead of K and V, with R an orthogonal D x D matrix, spreads a channel
with large values over all channels before the 1/2-bit quantizer sees it. Scores stay what they
were, q . k = (q R) . (k R), so the queries are rotated before the guide's score kernel; the
guide's share of the output is (p @ V R) R^T, so it is rotated back. Only the guide is
transformed: sinks, the residual window, the fetched set and the host store stay exact and
unrotated, so k >= context still gives the full cache's output.

Rotations (the guide option `rotation`):
- ``none``: R = I (nothing is done);
- ``hadamard``: the normalized Sylvester Hadamard matrix, block diagonal with blocks of the
  largest power of two dividing D (entries +-1/sqrt(block): exact in fp32 for D = 64).
"""
from __future__ import annotations

import functools
import math

import torch

from engine.config import ROTATIONS


def hadamard(d: int) -> torch.Tensor:
    """fp32 [d, d]: block-diagonal normalized Sylvester Hadamard matrix (orthogonal, symmetric)."""
    block = d & -d  # the largest power of two dividing d
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(block)] * (d // block)).float()


@functools.lru_cache(maxsize=16)
def _matrix(name: str, d: int, device: torch.device) -> torch.Tensor:
    return hadamard(d).to(device).contiguous()


def rotation_matrix(name: str, d: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The guide's R for `name` (one of engine.config.ROTATIONS; fp32 [d, d], shared read-only) or
    None for ``none``."""
    if name not in ROTATIONS:
        raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, not {name!r}")
    return None if name == "none" else _matrix(name, d, torch.device(device))
