"""Decode-step linears on the CPU: native kernels for a few rows, and exactly packed weights.

A decode step multiplies 1-8 activation rows by every weight matrix, so its linears are bound
by reading the weights. `SkinnyLinear` sends such calls to engine/native/linear_kernels.c. When
a weight matrix is exactly a block format (the embedded SmolLM2 ships as a GGUF with Q4_1
linears and a Q8_0 embedding, and its fp32 weights are their exact dequantization), it is also
kept packed (`PackedWeight`: 5 or 9 bits per weight) and the kernel rebuilds every weight bit
for bit from the blocks: same result as the fp32 kernel, 3.6-6.4x fewer bytes read. Prefill
chunks (many rows) and weights without an exact packing use the fp32 weights, or, with a
`prefill_dtype` (bf16, chosen by engine.model.loading.resolve_dtype where the CPU has native
bf16), a bf16 copy of them through torch's oneDNN GEMM (4-5x the fp32 rate on such a CPU).
"""
from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from engine import native
from engine.native import calibrate

ENV_PACK = "SPECACHE_PACK_WEIGHTS"  # 0/false/no/off: never pack (A/B runs)
BLOCK = 32
FORMATS = {4: 24, 8: 36}  # fmt -> bytes per block of 32 weights (affine4, scaled8)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] kept as blocks of 32 that rebuild it exactly (layout: linear_kernels.c)."""

    fmt: int  # 4: affine4, w = fma(d, q, m), q in 0..15; 8: scaled8, w = d * q, q int8
    data: torch.Tensor  # uint8 [N, K / 32 * FORMATS[fmt]]
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        # the kernel and the arguments that never change, bound once (a decode step makes ~200 calls)
        object.__setattr__(self, "_kernel", native.lib().specache_packed_linear)
        object.__setattr__(self, "_fixed", (self.data.data_ptr(), self.fmt, self.shape[0], self.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x [R <= 8, K] fp32 @ W^T (+ bias) by the native kernel; None where it does not apply.
        (The per-call checks are few: a decode step makes ~200 of these calls.)"""
        if x.shape[1] != self.shape[1] or not _kernel_takes(x, bias):
            return None
        rows, n = x.shape[0], self.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        rc = self._kernel(x.data_ptr(), x.stride(0), rows, *self._fixed, bias.data_ptr() if bias is not None else None,
                          y.data_ptr(), n, native.threads())
        return y if rc == 0 else None

    def unpack(self) -> torch.Tensor:
        """The fp32 weight it stands for [N, K] (tests and checks)."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=torch.float32)
        rc = native.lib().specache_unpack(self.data.data_ptr(), self.fmt, 0, n, k, out.data_ptr())
        assert rc == 0
        return out


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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 dot products or AMX tiles), so that
    torch's bf16 matmuls (oneDNN) run at bf16 speed instead of emulating it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # the native kernel only where it measured faster than torch for this weight form and row count
        fast = x.is_cpu and rows <= self.NATIVE_ROWS and calibrate.use_native(self.packed.fmt if self.packed else 0, rows)
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


@contextmanager
def prefill_pass() -> Iterator[None]:
    """Within: linears of many rows compute in their prefill_dtype (engine.generate.steps.prefill)."""
    token = _IN_PREFILL.set(True)
    try:
        yield
    finally:
        _IN_PREFILL.reset(token)


def skinny_torch_linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """flat [R <= 8, K] @ weight^T (+ bias) by torch as W @ x^T: the BLAS's x @ W^T path packs the
    weight matrix for 2-8 rows, so a 2-row step cost about twice a 1-row step that way."""
    y = (weight @ flat.T).T
    return y + bias if bias is not None else y


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


def use_skinny_linears(model: torch.nn.Module, prefill_dtype: torch.dtype | None = None) -> None:
    """Make every plain nn.Linear of the model a SkinnyLinear (same parameters, new forward) and
    pack the weights that pack exactly (unless $SPECACHE_PACK_WEIGHTS is 0). prefill_dtype: compute
    the linears of many rows (prefill chunks) in this dtype (bf16; None: the weight's own, exact)."""
    pack = packing_enabled()
    for module in model.modules():
        if type(module) in (torch.nn.Linear, SkinnyLinear):  # again: packs the weights anew
            module.__class__ = SkinnyLinear
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
