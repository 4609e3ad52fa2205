"""Triton kernels of the guide's math for CUDA: scores of queries against the packed 1/2-bit keys and
probabilities times the packed values, one launch each, reading the codes where they lie (no expanded
or dequantized copy; fp16 scale and zero, fp32 products and sums). The torch code in
engine.kvcache.quant is their reference (tests/test_guide_triton.py runs these kernels under Triton's
interpreter on the CPU against it); quant.guide_scores / guide_weighted_values call them on CUDA when
Triton is installed (the `gpu` extra; CUDA builds of torch bring it) and the layout applies.

Layout (engine.kvcache.quant's docstring): keys codes [B, H, J, bits, g/8, D] (byte row r, bit i ->
token i*g/8 + r of group j), scale/zero [B, H, J, D]; values codes [B, H, NB, bits, 8, D] (blocks of
64 tokens, byte row r, bit i -> token i*8 + r), scale/zero [B, H, n, D/g]. Rows may be a slice of the
batch (strides of B and H are passed); everything inside a head is contiguous."""
from __future__ import annotations

import functools
import importlib
import os
import sys

import torch

MIN_DOT = 16  # tl.dot's smallest dimension: the queries are padded to it


FAILED: dict[str, str] = {}  # per family ("guide", "gather", "decode"): the first launch error; then the fallback runs
FALLBACK = {"guide": "the torch code computes the guide", "gather": "a worker thread gathers the fetched rows",
            "decode": "the torch code decodes (engine/backends/triton_cuda.py)"}


def launch(family: str, kernel, grid, *args, **meta) -> bool:
    """Run a kernel of `family`. -> False after a launch error (a compiler or driver refusing it): noted once
    on stderr; that family's kernels are not used again in this process (available(family) is False;
    --json's guide_kernel says torch)."""
    try:
        kernel[grid](*args, **meta)
        return True
    except Exception as exc:  # noqa: BLE001  (Triton raises its own and the driver's errors)
        FAILED[family] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"specache: note: a Triton kernel failed ({FAILED[family]}); {FALLBACK[family]} from here on",
              file=sys.stderr)
        return False


def available(family: str) -> bool:
    """Whether the kernels of a family run here: Triton importable and none of them failed."""
    return family not in FAILED and kernels() is not None


@functools.lru_cache(maxsize=1)
def kernels():
    """(scores, values, gather) kernels of engine/backends/triton_code/guide_kernels.py, or None without Triton. Loaded on
    first use, by name (Triton is an optional dependency, and importing it costs ~0.25 s; Triton reads
    TRITON_INTERPRET when it jits them)."""
    try:
        mod = importlib.import_module("engine.backends.triton_code.guide_kernels")
    except ImportError:
        return None
    return mod.scores_kernel, mod.values_kernel, mod.gather_kernel


def _padded(x: int, least: int = MIN_DOT) -> int:
    return max(least, 1 << (x - 1).bit_length())


def _heads_contiguous(*tensors: torch.Tensor) -> bool:
    """Everything from dim 2 on laid out contiguously (a batch-row slice of a guide buffer is)."""
    for t in tensors:
        expected = 1
        for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:]))):
            if size != 1 and stride != expected:
                return False
            expected *= size
    return True


def guide_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int, group: int,
                 bits: int) -> torch.Tensor | None:
    """q [B, H, Q, D] against the first n (a multiple of group) quantized keys -> fp32 [B, H, Q, n], or None
    where the kernel does not apply (no Triton, another layout)."""
    ks = kernels()
    b, h, nq, d = q.shape
    if not available("guide") or n == 0 or n % group or group % 8 or group & (group - 1) or not _heads_contiguous(codes, scale,
                                                                                                         zero):
        return None
    qf = q.float()
    if qf.stride(-1) != 1:
        qf = qf.contiguous()
    out = torch.empty(b, h, nq, n, dtype=torch.float32, device=q.device)
    ok = launch("guide", ks[0], (b * h, n // group), qf, qf.stride(0), qf.stride(1), qf.stride(2), codes,
                codes.stride(0), codes.stride(1), scale, zero, scale.stride(0), scale.stride(1), out, out.stride(0), out.stride(1),
                out.stride(2), h, d, nq, G=group, BITS=bits, BLOCK_D=_padded(d), NQP=_padded(nq))
    return out if ok else None


def guide_weighted_values(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int,
                          group: int, bits: int, splits: int | None = None) -> torch.Tensor | None:
    """p [B, H, Q, n] times the first n quantized values -> fp32 [B, H, Q, D], or None where the kernel does
    not apply. The tokens are split among `splits` programs per head (default: enough for ~256 programs),
    whose partial sums are added after."""
    ks = kernels()
    b, h, nq, _ = p.shape
    d = codes.shape[-1]
    nb = -(-n // 64)
    if not available("guide") or n == 0 or d % group or not _heads_contiguous(codes, scale, zero):
        return None
    pf = p.float()
    if pf.stride(-1) != 1:
        pf = pf.contiguous()
    splits = max(1, min(nb, splits or -(-256 // (b * h))))
    per = -(-nb // splits)
    partial = torch.empty(splits, b * h, nq, d, dtype=torch.float32, device=p.device)
    ok = launch("guide", ks[1], (b * h, splits), pf, pf.stride(0), pf.stride(1), pf.stride(2), codes,
                codes.stride(0), codes.stride(1), scale, zero, scale.stride(0), scale.stride(1), partial, h, d, nq, n, nb, per,
                GV=group, BITS=bits, BLOCK_D=_padded(d), NQP=_padded(nq))
    return partial.sum(0).view(b, h, nq, d) if ok else None


def gather_applies(src_k: torch.Tensor, src_v: torch.Tensor, idx: torch.Tensor, dst_k: torch.Tensor,
                   dst_v: torch.Tensor, only: torch.Tensor | None = None) -> bool:
    """Whether gather_rows' kernel runs on these tensors: Triton there and the gather not failed, a layout it
    takes (the last dim of each contiguous, K and V alike), and a device Triton runs on (CPU tensors only in
    Triton's interpreter: a compiled kernel handed host pointers would fail and switch the gather off)."""
    if not available("gather") or idx.shape[-1] == 0 or (idx.device.type == "cpu" and not interpreted()):
        return False
    if src_k.stride() != src_v.stride() or dst_k.stride() != dst_v.stride():
        return False
    return all(t.stride(-1) == 1 for t in (src_k, src_v, dst_k, dst_v, idx)) and (only is None or only.stride(-1) == 1)


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1: with NumPy, on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def gather_rows(src_k: torch.Tensor, src_v: torch.Tensor, idx: torch.Tensor, dst_k: torch.Tensor,
                dst_v: torch.Tensor, only: torch.Tensor | None = None) -> bool:
    """dst[b, h, j] = src[b, h, idx[b, h, j]] for K and V in one launch: src [b, H, L, D] (on CUDA the pinned
    host store, read in place over the bus: mapped memory), idx [b, H, k] and dst [b, H, k, D] on the
    device; the last dim of each contiguous. only [b, H, k] bool: those slots alone are read and written (the
    rest of dst is kept). -> False where the kernel does not run (gather_applies, or a launch error): the
    caller gathers otherwise."""
    if not gather_applies(src_k, src_v, idx, dst_k, dst_v, only):
        return False
    ks = kernels()
    b, h, k = idx.shape
    d = src_k.shape[-1]
    mask = only.view(torch.uint8) if only is not None else idx  # (a pointer the kernel ignores without a mask)
    block = min(64, _padded(k, 1))
    return launch("gather", ks[2], (b * h, -(-k // block)), src_k, src_v, src_k.stride(0), src_k.stride(1),
                  src_k.stride(2), idx, idx.stride(0), idx.stride(1), mask, mask.stride(0), mask.stride(1), dst_k,
                  dst_v, dst_k.stride(0), dst_k.stride(1), dst_k.stride(2), h, k, d, BLOCK_K=block,
                  BLOCK_D=_padded(d, 1), MASKED=only is not None)
