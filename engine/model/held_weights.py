"""Weights held as blocks or as they are, and the native kernel calls on them.

`PackedWeight`: a weight [N, K] kept as blocks of 32 that rebuild it exactly: the affine4 / scaled8 records
`pack_weight` makes of an fp32 weight that is exactly one (the embedded SmolLM2's fp32 weights are the exact
dequantization of its Q4_1 / Q8_0 blocks: 5 or 9 bits per weight), or a GGUF's own Q4_0 / Q4_1 / Q8_0 /
Q5_0 / Q5_1 blocks. `DenseWeight`: fp32 / fp16 / bf16 as held in the file. The GGUF superblocks (Q4_K,
Q5_K, Q6_K) are PackedWeights of engine.model.kquant_weights. Decode rows (1-8 fp32) take the native
kernel (engine/native/linear_kernels.c) on the held bytes, bit for bit the fp32 kernel's result on the
rebuilt weight (`native_linear`: that fp32 kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.kernels import backend_for
from engine.model.block_formats import (BF16_FMT, BLOCK, CODE_BYTES, F16_FMT, FORMAT_NAMES, FORMATS,
                                        GGUF_BLOCK_FMTS, HALF_FMTS, MIN_FMTS, Q40_FMT, Q50_FMT, Q51_FMT, Q80_FMT,
                                        native_rows)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] kept as blocks of 32 that rebuild it exactly (layout: linear_kernels.c)."""

    fmt: int  # 4: affine4, w = fma(d, q, m), q in 0..15; 8: scaled8, w = d * q, q int8 (fp32 d, m); 2, 3, 9, 10, 11:
    # GGUF Q4_0 (m = -8 d), Q4_1, Q8_0, Q5_0 (m = -16 d), Q5_1 blocks' bytes (fp16 d, m), each row's codes then scales
    data: torch.Tensor  # uint8 [N, K / 32 * FORMATS[fmt]]
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        # the kernel and the arguments that never change, bound once (a decode step makes ~200 calls); None
        # without the native library: rows rebuilt by torch, no decode kernel
        object.__setattr__(self, "_kernel", backend_for(self.data.device).bind_packed(self.data, self.fmt, self.shape))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x [R <= 8, K] fp32 @ W^T (+ bias) by the native kernel; None where it does not apply.
        (The per-call checks are few: a decode step makes ~200 of these calls.)"""
        if self._kernel is None or x.dim() != 2 or x.shape[1] != self.shape[1] or not _kernel_takes(x, bias):
            return None
        return self._kernel(x, bias)

    @property
    def kind(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def decode(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self(x, bias)

    def rows(self, n0: int, n1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [n0, n1) of the fp32 weight it stands for, rebuilt bit for bit by the native kernel (in bf16:
        those floats rounded to nearest even, as .to(torch.bfloat16) rounds them)."""
        if self._kernel is None:
            return self.torch_rows(n0, n1).to(dtype)
        return native_rows(self.data, self.fmt, n0, n1, self.shape[1], dtype)

    def torch_rows(self, n0: int, n1: int) -> torch.Tensor:
        """rows() by torch (without the native library): the same floats, d * q being exact in both
        formats as packed here (fp16-sized d, 4-bit or 8-bit q), so d * q + m rounds once like fmaf."""
        n, nb = n1 - n0, self.shape[1] // BLOCK
        if self.fmt in GGUF_BLOCK_FMTS:
            q, d, m = self.gguf_parts(n0, n1)
            d, m = d[..., None], m[..., None] if m is not None else None  # [n, nb, 1]
            if self.fmt == Q80_FMT:
                return q.view(torch.int8).to(torch.float32).mul_(d).view(n, -1)
            if self.fmt in (Q50_FMT, Q51_FMT):  # the fifth bits: qh, bit j of weight j
                qh = q[..., 16:20].contiguous().view(torch.int32)  # [n, nb, 1]
                bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [n, nb, 32]
                low = torch.cat((q[..., :16] & 15, q[..., :16] >> 4), dim=-1).to(torch.int32)
                return (low | (bits << 4)).to(torch.float32).mul_(d).add_(m).view(n, -1)
        elif self.fmt in (BF16_FMT, F16_FMT):  # 16-bit weights: converted exactly
            dtype = torch.bfloat16 if self.fmt == BF16_FMT else torch.float16
            return self.data[n0:n1].contiguous().view(dtype).to(torch.float32)
        else:  # affine4 / scaled8 records: fp32 d (and m), then the codes
            rec = self.data[n0:n1].view(n, nb, FORMATS[self.fmt])
            d = rec[..., 0:4].contiguous().view(torch.float32)  # [n, nb, 1]
            if self.fmt == 8:
                return rec[..., 4:].view(torch.int8).to(torch.float32).mul_(d).view(n, -1)
            m, q = rec[..., 4:8].contiguous().view(torch.float32), rec[..., 8:]
        return torch.cat((q & 15, q >> 4), dim=-1).to(torch.float32).mul_(d).add_(m).view(n, -1)

    def gguf_parts(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows [n0, n1) of a GGUF 32-weight block format (GGUF_BLOCK_FMTS; a row is its nb blocks' codes, their
        fp16 d, then (MIN_FMTS) their fp16 m) -> codes uint8 [n, nb, CODE_BYTES], d and m fp32 [n, nb] (m: the
        stored one, -8 d for Q4_0, -16 d for Q5_0, None for Q8_0)."""
        n, nb, cb = n1 - n0, self.shape[1] // BLOCK, CODE_BYTES[self.fmt]
        row = self.data[n0:n1]
        half = lambda i: row[:, nb * cb + 2 * nb * i : nb * cb + 2 * nb * (i + 1)].contiguous().view(  # noqa: E731
            torch.float16).to(torch.float32)  # [n, nb]
        d = half(0)
        m = half(1) if self.fmt in MIN_FMTS else None if self.fmt == Q80_FMT else \
            d * (-8.0 if self.fmt == Q40_FMT else -16.0)
        return row[:, : nb * cb].reshape(n, nb, cb), d, m

    def unpack(self) -> torch.Tensor:
        """The fp32 weight it stands for [N, K] (tests and checks)."""
        return self.rows(0, self.shape[0])


@dataclass(frozen=True)
class DenseWeight:
    """A weight [N, K] held as it is in the file: fp32, or fp16 / bf16 (rebuilt to fp32 exactly; decode rows
    by the native kernel on the 16-bit bytes, fmt 12 / 13, where K % 32 == 0: the fp32 kernel's result on the
    converted weight bit for bit)."""

    w: torch.Tensor

    def __post_init__(self) -> None:
        fmt = HALF_FMTS.get(self.w.dtype)
        half = fmt is not None and self.w.dim() == 2 and self.w.shape[1] % BLOCK == 0 and self.w.is_contiguous()
        object.__setattr__(self, "_half", PackedWeight(fmt, self.w.view(torch.uint8), self.shape) if half else None)

    @property
    def kind(self) -> str:
        return str(self.w.dtype).removeprefix("torch.")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def decode(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self._half is not None:
            return self._half(x, bias)
        return native_linear(x, self.w, bias) if self.w.dtype == torch.float32 else None

    def rows(self, n0: int, n1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.w[n0:n1].to(dtype)

    torch_rows = rows  # torch's rebuild is its only one (PackedWeight's name for it)

    def unpack(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])


HeldWeight = PackedWeight | DenseWeight  # what a weightless SkinnyLinear computes with (Q6KWeight, KQuantWeight: PackedWeights)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """Pack an fp32 CPU weight [N, K] whose values are exactly affine4 (tried first) or scaled8
    blocks; None if neither fits, K is not a multiple of 32, or the native kernels are missing."""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
            or not weight.is_contiguous() or weight.shape[1] % BLOCK or weight.shape[1] < BLOCK):
        return None
    packed = backend_for(weight.device).pack_weight(weight, FORMATS)
    return PackedWeight(packed[0], packed[1], tuple(weight.shape)) if packed is not None else None


def _kernel_takes(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native linear kernels can read x [R, K] and bias as they are: fp32, rows
    contiguous along K, no gradient wanted."""
    return (x.dtype == torch.float32 and x.stride(-1) == 1 and not (x.requires_grad and torch.is_grad_enabled())
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [R <= 8, K] @ weight[N, K]^T (+ bias) by the native kernel; None where it does not apply
    (not available, not fp32, not contiguous, or gradients wanted)."""
    if weight.dtype != torch.float32 or not weight.is_contiguous() or not _kernel_takes(x, bias) \
            or (weight.requires_grad and torch.is_grad_enabled()):
        return None
    return backend_for(weight.device).linear(x, weight, bias)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """native_linear for a packed weight: the same numbers, fewer bytes read."""
    return packed(x, bias)
