"""Orthogonal transforms of the guide (bench-results/guide-study-findings.md): a guide
built from K R and V R instead of K and V, with R an orthogonal D x D matrix, spreads a channel
with large values over all channels before the 1/2-bit quantizer sees it. Scores stay what they
were, q . k = (q R) . (k R), so the queries are rotated before the guide's score kernel; the
guide's share of the output is (p @ V R) R^T, so it is rotated back. Only the guide is
transformed: sinks, the residual window, the fetched set and the host store stay exact and
unrotated, so k >= context still gives the full cache's output.

Rotations (the guide option `rotation`):
- ``none``: R = I (nothing is done);
- ``hadamard``: the normalized Sylvester Hadamard matrix, block diagonal with blocks of the
  largest power of two dividing D (entries +-1/sqrt(block): exact in fp32 for D = 64);
- ``auto``: per layer, measured on the first keys and values the guide quantizes (``rotation_helps``):
  the Hadamard where it quantizes them with less relative error than no rotation, else none. The keys
  are quantized per channel, so a rotation spreads a channel whose keys *vary* widely over every
  channel's range (Gemma 3's keys: ~10 channels of std 13-20 against a median of ~1; there the
  rotated 2-bit guide's attention output erred 0.40, the unrotated one 0.06:
  bench-results/fidelity-models.md); a channel that is only large but constant (Qwen2's k_proj bias)
  costs nothing either way, and values (per token) gain from it.
"""
from __future__ import annotations

import functools
import math

import torch

from engine.config import ROTATIONS
from engine.kvcache import quant
from engine.kvcache.sizes import value_group


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
    return None if name == "none" else _matrix("hadamard", d, torch.device(device))


# auto keeps the rotation (chosen by `bench fidelity`) unless it errs this much more than none; the per-layer errors on
# SmolLM2, Qwen2.5-Coder-1.5B and Gemma 3 that set it: docs/results.md, "The defaults on other real models"
KEEP_MARGIN = 1.5


def rotation_helps(k: torch.Tensor, v: torch.Tensor, r: torch.Tensor, bits: int, group: int,
                   q: torch.Tensor | None = None) -> bool:
    """k, v fp32 [1, H, n, D] (n % group == 0; keys without their outlier channels), q [1, H, m, D] the
    layer's latest queries (grouped per KV head) or None: True unless the guide of K R and V R errs more
    than KEEP_MARGIN times the guide of K and V. The error: the keys' relative squared score error with those queries (the
    scores' spread over positions is what softmax sees; the relative reconstruction error without them)
    plus the values' relative squared reconstruction error (R orthogonal: the same norms both ways)."""

    def key_error(x: torch.Tensor, queries: torch.Tensor | None) -> float:
        err = quant.dequantize_keys(quant.quantize_keys(x, bits, group)) - x
        if queries is None:
            return float(err.square().sum() / x.square().sum().clamp(min=1e-30))
        e, s = queries @ err.transpose(-1, -2), queries @ x.transpose(-1, -2)
        spread = lambda t: (t - t.mean(-1, keepdim=True)).square().sum()  # noqa: E731
        return float(spread(e) / spread(s).clamp(min=1e-30))

    def value_error(x: torch.Tensor) -> float:
        back = quant.dequantize_values(quant.quantize_values(x, bits, value_group(group, x.shape[-1])))
        return float((back - x).square().sum() / x.square().sum().clamp(min=1e-30))

    qr = None if q is None else q.float() @ r
    rotated = key_error(k @ r, qr) + value_error(v @ r)
    return rotated < KEEP_MARGIN * (key_error(k, None if q is None else q.float()) + value_error(v))
