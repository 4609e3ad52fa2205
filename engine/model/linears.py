"""Decode-step linears on the CPU: native kernels for a few rows, and exactly packed weights.

A decode step multiplies 1-8 activation rows by every weight matrix, so its linears are bound
by reading the weights. `SkinnyLinear` sends such calls to engine/native/linear_kernels.c. When
a weight matrix is exactly a block format (the embedded SmolLM2 ships as a GGUF with Q4_1
linears and a Q8_0 embedding, and its fp32 weights are their exact dequantization), it is also
kept packed (`PackedWeight`: 5 or 9 bits per weight) and the kernel rebuilds every weight bit
for bit from the blocks: same result as the fp32 kernel, 3.6-6.4x fewer bytes read. A GGUF's Q6_K
weights stay in their own superblocks (`Q6KWeight`, 6.6 bits per weight), which the same kernel
reads the same way (4.9x fewer bytes than fp32). Prefill
chunks (many rows) and weights without an exact packing use the fp32 weights, or, with a
`prefill_dtype` (bf16, chosen by engine.model.loading.resolve_dtype where the CPU has native
bf16), a bf16 copy of them through torch's oneDNN GEMM (4-5x the fp32 rate on such a CPU).
"""
from __future__ import annotations

import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from engine import native
from engine.native import calibrate
from engine.native.calibrate import skinny_torch_linear
from engine.model.decode_kernels import DecodeCall, decode_call

ENV_PACK = "SPECACHE_PACK_WEIGHTS"  # 0/false/no/off: never pack (A/B runs)
BLOCK = 32
Q40_FMT, Q41_FMT, Q80_FMT, Q50_FMT, Q51_FMT = 2, 3, 9, 10, 11  # a GGUF's own 32-weight blocks (linear_kernels.c)
GGUF_BLOCK_FMTS = (Q40_FMT, Q41_FMT, Q80_FMT, Q50_FMT, Q51_FMT)  # fp16 scales; rows split into codes, then scales
BF16_FMT, F16_FMT = 12, 13  # 16-bit weights as they are, K % 32 == 0 (linear_kernels.c)
HALF_FMTS = {torch.bfloat16: BF16_FMT, torch.float16: F16_FMT}
FORMATS = {4: 24, 8: 36, Q40_FMT: 18, Q41_FMT: 20, Q80_FMT: 34, Q50_FMT: 22, Q51_FMT: 24,  # bytes per 32 weights
           BF16_FMT: 64, F16_FMT: 64}
CODE_BYTES = {Q40_FMT: 16, Q41_FMT: 16, Q80_FMT: 32, Q50_FMT: 20, Q51_FMT: 20}  # a block's codes (Q5: qs, qh)
MIN_FMTS = (Q41_FMT, Q51_FMT)  # a stored fp16 m; Q4_0 / Q5_0: m = -8 d / -16 d


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] kept as blocks of 32 that rebuild it exactly (layout: linear_kernels.c)."""

    fmt: int  # 4: affine4, w = fma(d, q, m), q in 0..15; 8: scaled8, w = d * q, q int8 (fp32 d, m); 2, 3, 9, 10, 11:
    # GGUF Q4_0 (m = -8 d), Q4_1, Q8_0, Q5_0 (m = -16 d), Q5_1 blocks' bytes (fp16 d, m), each row's codes then scales
    data: torch.Tensor  # uint8 [N, K / 32 * FORMATS[fmt]]
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        # the kernel and the arguments that never change, bound once (a decode step makes ~200 calls)
        lib = native.lib()  # None without the native library: rows rebuilt by torch, no decode kernel
        object.__setattr__(self, "_kernel", lib.specache_packed_linear if lib is not None else None)
        object.__setattr__(self, "_fixed", (self.data.data_ptr(), self.fmt, self.shape[0], self.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x [R <= 8, K] fp32 @ W^T (+ bias) by the native kernel; None where it does not apply.
        (The per-call checks are few: a decode step makes ~200 of these calls.)"""
        if self._kernel is None or x.dim() != 2 or x.shape[1] != self.shape[1] or not _kernel_takes(x, bias):
            return None
        rows, n = x.shape[0], self.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        rc = self._kernel(x.data_ptr(), x.stride(0), rows, *self._fixed, bias.data_ptr() if bias is not None else None,
                          y.data_ptr(), n, native.threads())
        return y if rc == 0 else None

    @property
    def kind(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def decode(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self(x, bias)

    def rows(self, n0: int, n1: int) -> torch.Tensor:
        """Rows [n0, n1) of the fp32 weight it stands for, rebuilt bit for bit by the native kernel."""
        if self._kernel is None:
            return self.torch_rows(n0, n1)
        return native_rows(self.data, self.fmt, n0, n1, self.shape[1])

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


Q6K_FMT, Q4K_FMT, Q5K_FMT = 6, 7, 5  # the native kernels' format numbers of GGUF superblocks (linear_kernels.c)
FORMAT_NAMES = {4: "affine4", 8: "scaled8", Q40_FMT: "q4_0", Q41_FMT: "q4_1", Q80_FMT: "q8_0", Q50_FMT: "q5_0",
                Q51_FMT: "q5_1", Q6K_FMT: "q6_k", Q4K_FMT: "q4_k", Q5K_FMT: "q5_k", BF16_FMT: "bfloat16",
                F16_FMT: "float16"}
SUPERBLOCK_BYTES = {Q6K_FMT: 210, Q4K_FMT: 144, Q5K_FMT: 176}  # bytes per 256 weights (linear_kernels.c)
PARALLEL_UNPACK = 1 << 18  # weights from which a tile is rebuilt on several threads
_pools: dict[int, ThreadPoolExecutor] = {}


def native_rows(data: torch.Tensor, fmt: int, n0: int, n1: int, k: int) -> torch.Tensor:
    """Rows [n0, n1) [n1 - n0, k] fp32 of the block weight data (uint8 [N, row bytes], format fmt)
    rebuilt by the native specache_unpack (a large tile split over the native threads: the kernel is
    single-threaded, ctypes frees the GIL). Needs the native library."""
    out = torch.empty(n1 - n0, k, dtype=torch.float32)
    unpack, threads = native.lib().specache_unpack, native.threads()

    def part(a: int, b: int) -> int:
        return unpack(data.data_ptr(), fmt, a, b, k, out[a - n0:].data_ptr())

    if threads > 1 and (n1 - n0) * k >= PARALLEL_UNPACK and n1 - n0 >= threads:
        cuts = [n0 + (n1 - n0) * t // threads for t in range(threads + 1)]
        rcs = list(_pool(threads).map(part, cuts[:-1], cuts[1:]))
    else:
        rcs = [part(n0, n1)]
    assert not any(rcs)
    return out


def _pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="specache-unpack")
    return _pools[threads]


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

    def rows(self, n0: int, n1: int) -> torch.Tensor:
        return self.w[n0:n1].to(torch.float32)

    torch_rows = rows  # torch's rebuild is its only one (PackedWeight's name for it)

    def unpack(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])


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


HeldWeight = PackedWeight | DenseWeight  # what a weightless SkinnyLinear computes with (Q6KWeight, KQuantWeight: PackedWeights)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """Pack an fp32 CPU weight [N, K] whose values are exactly affine4 (tried first) or scaled8
    blocks; None if neither fits, K is not a multiple of 32, or the native kernels are missing."""
    lib = native.lib()
    if (lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
            or not weight.is_contiguous() or weight.shape[1] % BLOCK or weight.shape[1] < BLOCK):
        return None
    n, k = weight.shape
    for fmt, packer in ((4, lib.specache_pack_affine4), (8, lib.specache_pack_scaled8)):
        data = torch.empty(n, k // BLOCK * FORMATS[fmt], dtype=torch.uint8)
        if packer(weight.data_ptr(), n, k, data.data_ptr()) == 0:
            return PackedWeight(fmt, data, (n, k))
    return None


# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that still include bf16 dot products or AMX tiles
_BF16_ONEDNN_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 dot products or AMX tiles) AND torch may
    use them, so that its bf16 matmuls (oneDNN) run at bf16 speed instead of emulating it. A torch held
    below AVX-512 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: the AVX2 stand-in) emulates bf16
    in a slow scalar loop, as a CPU without the instructions would: there the prefill stays fp32."""
    if not native.cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return limit.startswith(_BF16_ONEDNN_ISAS)


class SkinnyLinear(torch.nn.Linear):
    """nn.Linear that is fast for a few rows of input (decode steps) on the CPU.

    For 1-8 fp32 rows it calls the native kernel, on the packed weight when there is one
    (`packed`, set by `use_skinny_linears`), and up to NATIVE_ROWS in calls of 8 rows. Without the native library, W @ x^T: the BLAS's
    x @ W^T path packs the weight matrix for 2-8 rows, so a speculative step (2 tokens) cost
    about twice a 1-token step. Prefill chunks (many rows) keep the ordinary path. Same result
    up to float rounding order. The packed copy is taken when the model is prepared: weights
    changed in place afterwards need `use_skinny_linears` again."""

    SKINNY_ROWS = 8  # rows per native kernel call
    # rows taken by the native kernel in calls of SKINNY_ROWS (an exact-mode verification: batch x
    # (gamma + 1) rows; large decode batches). Measured on this project's CPU (1 thread, SmolLM2's 211
    # linears): packed weights 28 rows 56.6 ms vs torch fp32 114 ms, 64 rows 124 vs 211; unpacked fp32
    # 28 rows 95 vs 113, 64 rows 190 vs 201. Prefill chunks (more rows) keep torch's GEMM.
    NATIVE_ROWS = 64
    packed: PackedWeight | None = None
    # many rows (prefill) in this dtype (bf16) instead of the weight's (fp32): set by use_skinny_linears
    prefill_dtype: torch.dtype | None = None
    _prefill_weight: torch.Tensor | None = None  # the weight in prefill_dtype, made on the first prefill call

    held: HeldWeight | None = None  # the only copy of the weight (self.weight is None): read from a GGUF
    # decode rows (1-8, outside prefill_pass) of a held block weight: the chosen native kernel, bound once
    # (engine.model.decode_kernels; set by use_skinny_linears)
    decoder: DecodeCall | None = None
    TILE_ELEMENTS = 1 << 20  # weights rebuilt at a time for many rows (4 MiB in fp32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decoder is not None and not _IN_PREFILL.get():  # a decode step's held linear: the lean path
            y = self.decoder(x)
            if y is not None:
                return y
        rows = x.numel() // x.shape[-1]
        if self.weight is None:  # held in its blocks only: the native kernel on them, or tiles rebuilt
            return self.held_forward(x.reshape(rows, -1)).reshape(*x.shape[:-1], -1)
        # the native kernel only where it measured faster than torch for this weight form and row count
        by = 1 if _ROW_INVARIANT.get() else rows  # exact mode: the one-row step's kernel for every row count
        fast = x.is_cpu and rows <= self.NATIVE_ROWS and calibrate.use_native(self.packed.fmt if self.packed else 0, by)
        if rows > self.SKINNY_ROWS or not x.is_cpu:
            if self.prefill_dtype is not None and x.is_cpu and x.dtype != self.prefill_dtype and _IN_PREFILL.get():
                return self.prefill_forward(x)
            y = self.native_chunks(x.reshape(rows, -1)) if fast else None
            return super().forward(x) if y is None else y.reshape(*x.shape[:-1], -1)
        flat = x.reshape(rows, -1)
        y = self.native(flat) if fast else None
        if y is None:
            y = skinny_torch_linear(flat, self.weight, self.bias)
        return y.reshape(*x.shape[:-1], -1)

    def held_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [R, K] @ W^T (+ bias) for a weight held only in its blocks: decode rows by the native
        kernel on the blocks (bit for bit the fp32 kernel's result), else a tile of output rows at a
        time rebuilt in fp32 and multiplied (in prefill_dtype within a prefill pass)."""
        prefill = _IN_PREFILL.get()
        fast = self.prefill_dtype is not None and prefill
        if not fast and flat.shape[0] <= self.NATIVE_ROWS:
            parts, dec = [], self.decoder if not prefill else None  # prefill chunks: the exact kernel
            for s in range(0, flat.shape[0], self.SKINNY_ROWS):
                rows = flat[s : s + self.SKINNY_ROWS]
                y = dec(rows) if dec is not None else self.held.decode(rows, self.bias)
                if y is None:
                    break
                parts.append(y)
            else:
                return torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.tiled_forward(flat, self.prefill_dtype if fast else None)

    def tiled_forward(self, flat: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """flat [R, K] @ W^T (+ bias), W rebuilt TILE_ELEMENTS weights at a time (never whole); a weight
        held in the prefill dtype itself (a bf16 folder's) multiplies as it is, as prefill_forward does."""
        w16 = getattr(self.held, "w", None)
        if dtype is not None and w16 is not None and w16.dtype == dtype:
            y = torch.nn.functional.linear(flat.to(dtype), w16).to(flat.dtype)
            return y + self.bias if self.bias is not None else y
        n, k = self.held.shape
        step = max(16, self.TILE_ELEMENTS // k // 16 * 16)
        x = flat.to(dtype) if dtype is not None else flat
        y = torch.empty(flat.shape[0], n, dtype=flat.dtype)
        tile = torch.empty(min(step, n), k, dtype=dtype) if dtype is not None else None
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            w = self.held.rows(n0, n1)
            if tile is not None:
                w = tile[: n1 - n0].copy_(w)
            torch.matmul(x, w.T, out=y[:, n0:n1]) if y.dtype == w.dtype else y[:, n0:n1].copy_(x @ w.T)
        return y.add_(self.bias) if self.bias is not None else y

    def native(self, flat: torch.Tensor) -> torch.Tensor | None:
        """flat [R <= SKINNY_ROWS, K] @ W^T (+ bias) by the native kernel (packed weight first); None
        where it does not apply."""
        y = self.packed(flat, self.bias) if self.packed is not None else None
        return y if y is not None else native_linear(flat, self.weight, self.bias)

    def native_chunks(self, flat: torch.Tensor) -> torch.Tensor | None:
        """flat [R <= NATIVE_ROWS, K] in calls of SKINNY_ROWS rows (each row's result is what it
        would be alone); None where the kernel does not apply."""
        parts = []
        for s in range(0, flat.shape[0], self.SKINNY_ROWS):
            y = self.native(flat[s : s + self.SKINNY_ROWS])
            if y is None:
                return None
            parts.append(y)
        return torch.cat(parts)

    def prefill_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (many rows, fp32) @ W^T in prefill_dtype (bf16: inputs and weights rounded to
        8-bit mantissas, fp32 accumulation inside the GEMM, the result rounded to bf16 and returned in
        x's dtype). 4-5x faster than fp32 on a CPU with AVX512-BF16 (docs/engine.md, Prefill)."""
        if self._prefill_weight is None:
            self._prefill_weight = self.weight.detach().to(self.prefill_dtype)
        y = torch.nn.functional.linear(x.to(self.prefill_dtype), self._prefill_weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y


# True inside prefill_pass(): a prompt chunk, whose many rows may take the prefill dtype. Context-local,
# like torch.no_grad(); every other pass (decode steps of large batches, exact mode's verification) stays exact.
_IN_PREFILL: contextvars.ContextVar[bool] = contextvars.ContextVar("specache_in_prefill", default=False)


# True inside row_invariant(): a decode linear of up to NATIVE_ROWS rows takes the kernel that one row of
# its weight form takes (the calibration's 1-row choice), so each row's result is the one-row step's (the
# native kernel computes every row alone: tests/test_linears.py). Exact mode's drafts and verification.
_ROW_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("specache_row_invariant", default=False)


@contextmanager
def _set_within(var: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = var.set(True)
    try:
        yield
    finally:
        var.reset(token)


def row_invariant():
    """Within: decode linears choose their kernel by the one-row class, whatever their row count."""
    return _set_within(_ROW_INVARIANT)


def prefill_pass():
    """Within: linears of many rows compute in their prefill_dtype (engine.generate.steps.prefill)."""
    return _set_within(_IN_PREFILL)


def _kernel_takes(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native linear kernels can read x [R, K] and bias as they are: fp32, rows
    contiguous along K, no gradient wanted."""
    return (x.dtype == torch.float32 and x.stride(-1) == 1 and not (x.requires_grad and torch.is_grad_enabled())
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [R <= 8, K] @ weight[N, K]^T (+ bias) by the native kernel; None where it does not apply
    (not available, not fp32, not contiguous, or gradients wanted)."""
    lib = native.lib()
    if lib is None or weight.dtype != torch.float32 or not weight.is_contiguous() or not _kernel_takes(x, bias) \
            or (weight.requires_grad and torch.is_grad_enabled()):
        return None
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    rc = lib.specache_skinny_linear(x.data_ptr(), x.stride(0), rows, weight.data_ptr(), n, k,
                                    bias.data_ptr() if bias is not None else None, y.data_ptr(), n, native.threads())
    return y if rc == 0 else None


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """native_linear for a packed weight: the same numbers, fewer bytes read."""
    return packed(x, bias)


def packing_enabled() -> bool:
    raw = os.environ.get(ENV_PACK)
    return raw is None or raw.strip().lower() not in ("0", "false", "no", "off")


def use_skinny_linears(model: torch.nn.Module, prefill_dtype: torch.dtype | None = None,
                       decode_linear: str = "exact") -> None:
    """Make every plain nn.Linear of the model a SkinnyLinear (same parameters, new forward) and
    pack the weights that pack exactly (unless $SPECACHE_PACK_WEIGHTS is 0). prefill_dtype: compute
    the linears of many rows (prefill chunks) in this dtype (bf16; None: the weight's own, exact).
    decode_linear: the native kernel of held block weights' decode rows (engine.model.decode_kernels:
    exact, int8)."""
    pack = packing_enabled()
    for module in model.modules():
        if type(module) in (torch.nn.Linear, SkinnyLinear):  # again: packs the weights anew
            module.__class__ = SkinnyLinear
            if module.weight is None:  # held in its blocks only (a GGUF model): nothing to pack
                module.prefill_dtype = prefill_dtype
                module.decoder = decode_call(module.held, module.bias, decode_linear)
                continue
            module.decoder = None
            module.packed = pack_weight(module.weight.detach()) if pack else None
            fast = prefill_dtype is not None and prefill_dtype != module.weight.dtype
            module.prefill_dtype = prefill_dtype if fast else None
            module._prefill_weight = None


def packed_summary(model: torch.nn.Module) -> dict:
    """How many linears are packed and the bytes their packed and fp32 weights take."""
    linears = [m for m in model.modules() if isinstance(m, SkinnyLinear)]
    packed = [m for m in linears if m.packed is not None]
    return {"linears": len(linears), "packed": len(packed),
            "packed_bytes": sum(m.packed.nbytes for m in packed),
            "fp32_bytes": sum(m.weight.numel() * 4 for m in packed)}


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
