"""The block formats of the decode linears' weights (engine/native/linear_kernels.c and block_codes.h): their
format numbers, names and sizes, and the native rebuild of a block weight's rows in fp32 or bf16 (native_rows).
The weight types that hold them are engine.model.held_weights' and engine.model.kquant_weights'.
"""
from __future__ import annotations

import torch

from engine.backends.kernels import backend_for

BLOCK = 32
Q40_FMT, Q41_FMT, Q80_FMT, Q50_FMT, Q51_FMT = 2, 3, 9, 10, 11  # a GGUF's own 32-weight blocks (linear_kernels.c)
GGUF_BLOCK_FMTS = (Q40_FMT, Q41_FMT, Q80_FMT, Q50_FMT, Q51_FMT)  # fp16 scales; rows split into codes, then scales
BF16_FMT, F16_FMT = 12, 13  # 16-bit weights as they are, K % 32 == 0 (linear_kernels.c)
HALF_FMTS = {torch.bfloat16: BF16_FMT, torch.float16: F16_FMT}
FORMATS = {4: 24, 8: 36, Q40_FMT: 18, Q41_FMT: 20, Q80_FMT: 34, Q50_FMT: 22, Q51_FMT: 24,  # bytes per 32 weights
           BF16_FMT: 64, F16_FMT: 64}
CODE_BYTES = {Q40_FMT: 16, Q41_FMT: 16, Q80_FMT: 32, Q50_FMT: 20, Q51_FMT: 20}  # a block's codes (Q5: qs, qh)
MIN_FMTS = (Q41_FMT, Q51_FMT)  # a stored fp16 m; Q4_0 / Q5_0: m = -8 d / -16 d
Q6K_FMT, Q4K_FMT, Q5K_FMT = 6, 7, 5  # the native kernels' format numbers of GGUF superblocks (linear_kernels.c)
FORMAT_NAMES = {4: "affine4", 8: "scaled8", Q40_FMT: "q4_0", Q41_FMT: "q4_1", Q80_FMT: "q8_0", Q50_FMT: "q5_0",
                Q51_FMT: "q5_1", Q6K_FMT: "q6_k", Q4K_FMT: "q4_k", Q5K_FMT: "q5_k", BF16_FMT: "bfloat16",
                F16_FMT: "float16"}
SUPERBLOCK_BYTES = {Q6K_FMT: 210, Q4K_FMT: 144, Q5K_FMT: 176}  # bytes per 256 weights (linear_kernels.c)


def native_rows(data: torch.Tensor, fmt: int, n0: int, n1: int, k: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [n0, n1) [n1 - n0, k] of the block weight data (uint8 [N, row bytes], format fmt) rebuilt by the
    native specache_unpack over the native threads: fp32, bit for bit the blocks' values, or bf16, those
    rounded to nearest even as .to(torch.bfloat16) rounds them (a bf16 prefill's tile, with no fp32 copy
    on the way). Needs the native library."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native_rows rebuilds fp32 or bf16, not {dtype}")
    out = backend_for("cpu").unpack_rows(data, fmt, n0, n1, k, dtype)
    if out is None:
        raise RuntimeError("native_rows needs the native library")
    return out
