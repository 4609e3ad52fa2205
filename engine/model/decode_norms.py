"""A decode step's RMSNorms and rotary embeddings by one native call each (engine/native/norm_kernels.c), beside
their torch references (the modules' own forward: what prefill chunks, the exact path and the tests run).

In a decode step these act on 1-8 rows of a few hundred floats, where torch's per-op dispatch (~3-5 us) is the
cost: a Gemma 3 layer spends ~45 ops on its four norms, q/k norms and ropes, a Llama layer ~14. The native
calls are not the torch ops' floats bit for bit (a 16-lane sum of squares, fused multiply-adds), so they are
part of the fast decode path and nothing else: prepare_model turns them on (use_decode_norms) for a model held
in its GGUF blocks whose decode linears are not the exact kernel (engine.model.decode_kernels: int16 by default
on x86); $SPECACHE_DECODE_LINEAR=exact keeps the whole step the de-quantized fp32 model's, bit for bit.
"""
from __future__ import annotations

import torch

from engine.backends.kernels import backend_for
from engine.model.linear_passes import IN_PREFILL

MAX_ROWS = 64  # decode rows (batch x tokens of a step) the native calls take; more: the torch path


def _takes(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and not IN_PREFILL.get()
            and 0 < x.numel() // x.shape[-1] <= MAX_ROWS)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, res: torch.Tensor | None = None) -> torch.Tensor | None:
    """res + (x * rsqrt(mean(x^2) + eps)) * scale over the last dim of x (fp32, contiguous, 1-64 rows, outside a
    prefill pass) by the native call; None where it does not apply (the caller's torch path then runs)."""
    return backend_for(x.device).rms_norm(x, scale, eps, res) if _takes(x) else None


def norm_rope(parts: tuple[tuple[torch.Tensor, torch.Tensor | None], ...], head_dim: int, eps: float,
              cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """In place, for each (y, scale) of parts, y [b, T, heads * head_dim] a projection's output: each head's RMSNorm
    by scale (skipped for None), then the rope of cos / signed sin [b or 1, 1, T, head_dim] (rope_tables).
    False, touching nothing, where the native call does not take every part (the caller's torch path then runs)."""
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    b, t = parts[0][0].shape[0], parts[0][0].shape[1]
    if cos.shape != sin.shape or cos.shape[-2:] != (t, head_dim) or cos.shape[0] not in (1, b):
        return False
    for y, scale in parts:
        if not _takes(y) or y.dim() != 3 or y.shape[:2] != (b, t) or y.shape[-1] % head_dim:
            return False
        if scale is not None and (scale.dtype != torch.float32 or not scale.is_contiguous()):
            return False
    return backend_for(cos.device).norm_rope(parts, head_dim, eps, cos, sin)


def use_decode_norms(model: torch.nn.Module, on: bool) -> None:
    """Every module with a `native_decode` switch (the norms and attention modules of engine.model.llama and
    engine.model.gemma) takes the native calls in decode steps when on."""
    for module in model.modules():
        if hasattr(module, "native_decode"):
            module.native_decode = on
