"""Weights held in a GGUF's own K-quant superblocks of 256 weights: `Q6KWeight` (Q6_K) and `KQuantWeight`
(Q4_K, Q5_K), PackedWeights (engine.model.held_weights) of the native kernels' formats 6, 7 and 5, with
the torch rebuild of their rows (gguf.quants.dequantize's floats) for where the native library is missing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.block_formats import Q4K_FMT, Q5K_FMT, Q6K_FMT, SUPERBLOCK_BYTES
from engine.model.held_weights import PackedWeight


@dataclass(frozen=True)
class Q6KWeight(PackedWeight):
    """A weight [N, K] held in the GGUF's own Q6_K blocks (210 bytes per 256 weights: 16 sub-blocks of
    16 with an int8 scale under one fp16 d, 6-bit codes split in 4 + 2 bits; K a multiple of 256), whose
    weights are w = (d * sc) * (q - 32), the product rounded once, as gguf.quants dequantizes them.
    A PackedWeight of the native kernels' format Q6K_FMT: decode rows (1-8 fp32) take the same native
    kernel on these bytes (linear_kernels.c, fmt 6: bit for bit the fp32 kernel's result on unpack(),
    reading 6.6 bits a weight instead of 32); other passes rebuild tiles of rows (native
    specache_unpack, else torch_rows below: the same floats)."""

    def __post_init__(self) -> None:  # data: uint8 [N, K / 256 * 210], contiguous
        assert self.fmt == Q6K_FMT, self.fmt
        super().__post_init__()

    def torch_rows(self, n0: int, n1: int) -> torch.Tensor:
        """rows() by torch, gguf.quants.dequantize's floats: q from ql / qh, (d * sc) exact, one rounding."""
        n, nb = n1 - n0, self.shape[1] // 256
        b = self.data[n0:n1].view(n, nb, SUPERBLOCK_BYTES[Q6K_FMT])
        ql = b[..., :128].reshape(n, nb, 2, 1, 64)
        ql = torch.cat((ql & 15, ql >> 4), dim=3).reshape(n, nb, 256)
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, nb, 256)
        q = (ql | (qh << 4)).to(torch.float32).sub_(32).view(n, nb, 16, 16)
        d = b[..., 208:210].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
        scale = d * b[..., 192:208].view(torch.int8).to(torch.float32)  # [n, nb, 16], exact
        return q.mul_(scale[..., None]).view(n, -1)


@dataclass(frozen=True)
class KQuantWeight(PackedWeight):
    """A weight [N, K] held in the GGUF's own Q4_K (144 bytes per 256 weights) or Q5_K (176 bytes)
    superblocks: eight chunks of 32 under 6-bit scales sc and mins mn of one fp16 d and dmin, 4-bit codes
    (and, Q5_K, a fifth bit each), w = (d * sc) * q - dmin * mn with one rounding, as gguf.quants
    dequantizes them. A PackedWeight of format Q4K_FMT or Q5K_FMT: decode rows take the native kernel on
    these bytes (linear_kernels.c: bit for bit the fp32 kernel's result on unpack()); tiles are rebuilt
    natively or by torch_rows below (the same floats)."""

    def __post_init__(self) -> None:  # data: uint8 [N, K / 256 * (144 or 176)], contiguous
        assert self.fmt in (Q4K_FMT, Q5K_FMT), self.fmt
        super().__post_init__()

    def torch_rows(self, n0: int, n1: int) -> torch.Tensor:
        """rows() by torch, gguf.quants.dequantize's floats: (d * sc) and (dmin * mn) exact, one rounding."""
        q, scale, minus = self.chunks(n0, n1)
        return q.to(torch.float32).mul_(scale[..., None]).sub_(minus[..., None]).view(n1 - n0, -1)

    def chunks(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [n0, n1) as chunks of 32: codes q uint8 [n, K / 32, 32] (0..15 or 0..31), d * sc and
        dmin * mn fp32 [n, K / 32] (exact products); a weight is q * (d * sc) - dmin * mn."""
        n, nb = n1 - n0, self.shape[1] // 256
        b = self.data[n0:n1].view(n, nb, SUPERBLOCK_BYTES[self.fmt])
        d = b[..., 0:2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
        dmin = b[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
        s = b[..., 4:16].to(torch.int32)  # [n, nb, 12]
        lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat((lo & 63, (top & 15) | ((lo >> 6) << 4)), dim=-1)  # [n, nb, 8]
        mn = torch.cat((mid & 63, (top >> 4) | ((mid >> 6) << 4)), dim=-1)
        qs = b[..., -128:].reshape(n, nb, 4, 1, 32)
        q = torch.cat((qs & 15, qs >> 4), dim=3).reshape(n, nb, 8, 32)
        if self.fmt == Q5K_FMT:
            qh = b[..., 16:48].reshape(n, nb, 1, 32)
            q = q | (torch.cat([(qh >> j) & 1 for j in range(8)], dim=2) << 4)
        return q.view(n, -1, 32), (d * sc.to(torch.float32)).view(n, -1), (dmin * mn.to(torch.float32)).view(n, -1)
