"""Which native kernel a decode step's linears on GGUF block weights take, and the lean call that runs it.

Two kernels, one declared choice (never a silent one):

    exact   engine/native/linear_kernels.c: every weight rebuilt in fp32 and multiplied by the fp32
            activation; the result is the de-quantized fp32 model's bit for bit.
    int8    engine/native/int8_linear.c: each activation row quantized once per call to int8 per 32
            values (dx = amax / 127), integer dot products with the blocks' codes, one float scale per
            32 (16 for Q6_K), the blocks' mins against the exact float sums of x; as llama.cpp computes.
            Not the fp32 product: per block of 32 its error is at most (dx / 2) sum |d q| (the rounding
            of the activations) plus float rounding; `int_reference` below is its torch reference (the
            same quantization in float64), tests/test_decode_kernels.py holds the kernel to both.
    int16   the same kernel with the activations quantized to int16 per 32 (dx = amax / 32767): ~256x
            smaller activation error, integer products still (vpdpwssd / vpmaddwd / smull).

The choice is per machine, from one table (engine.backends.native_cpu.DECODE_LINEAR_BY_ISA: the native
library's instruction set), unless
$SPECACHE_DECODE_LINEAR says exact, int8 or int16; prepare_model records it on the model (specache_decode_linear),
and with an integer kernel it also turns on the native norms and ropes of the decode step (engine.model.decode_norms):
the fast path is one choice, the exact path the other.
It applies to decode passes only: a prefill chunk's linears (prefill_pass) keep the exact kernel (or the
prefill dtype), so the K/V a document store keeps do not depend on it. Each row of a several-row call is
computed alone in both kernels, so exact mode's verification reproduces the one-row steps either way.
Measured with scripts/bench_decode_kernels.py (2-core Zen 4, 1 thread, a [2048, 1024] weight, G weights/s exact /
int16 / int8): AVX-512 Q4_0 17.1 / 19.2 / 25.0, Q5_0 10.4 / 15.4 / 20.3, Q8_0 16.2 / 18.3 / 22.0, Q4_K 7.0 / 12.2 /
13.3, Q6_K 11.2 / 13.9 / 15.3; AVX2 (-march=x86-64-v3) Q4_0 13.0 / 19.2 / 23.6, Q5_0 8.7 / 14.5 / 17.6, Q8_0 14.0 /
21.5 / 26.0, Q4_K 7.1 / 11.0 / 15.5, Q6_K 9.4 / 12.3 / 11.8 (bench-results/decode-kernels.md).
"""
from __future__ import annotations

import os

import torch

from engine.backends.kernels import backend_for
from engine.backends.native_cpu import default_decode_linear

ENV = "SPECACHE_DECODE_LINEAR"
CHOICES = ("exact", "int8", "int16")
BITS = {"int8": 8, "int16": 16}  # the activations' width in the integer kernels
INT8_FMTS = frozenset({2, 3, 9, 10, 11, 5, 6, 7})  # Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q4_K
BLOCK = 32


def choose(setting: str | None = None) -> str:
    """The decode kernel: setting (or $SPECACHE_DECODE_LINEAR) when it is one of CHOICES, else (auto, unset)
    the CPU backend's for this machine (engine.backends.native_cpu.default_decode_linear). Raises ValueError for
    another value."""
    raw = (setting if setting is not None else os.environ.get(ENV, "auto")).strip().lower() or "auto"
    if raw == "auto":
        return default_decode_linear()
    if raw not in CHOICES:
        raise ValueError(f"${ENV} must be auto, {', '.join(CHOICES)}, not {raw!r}")
    return raw


def decode_call(held, bias: torch.Tensor | None, kernel: str):
    """The bound call for a held weight under the chosen kernel; None where neither native kernel takes it
    (no native library, a dense fp32 weight, a bias the kernel cannot read)."""
    if not hasattr(held, "fmt") or not hasattr(held, "data"):
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.device.type != "cpu"):
        return None
    bits = BITS[kernel] if kernel in BITS and held.fmt in INT8_FMTS else None
    return backend_for("cpu").bind_linear(held, bias, bits)


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] fp32 -> (q [R, K] int8 or int16, dx [R, K / 32], sums [R, K / 32]) as the integer kernels quantize
    it (torch: top = 2^(bits - 1) - 1, dx = amax / top, q = round(x * (top / amax)) half to even, sums in order)."""
    r, k = x.shape
    top = float(2 ** (bits - 1) - 1)
    b = x.reshape(r, k // BLOCK, BLOCK)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    q = torch.round(b * inv[..., None]).to(torch.int8 if bits == 8 else torch.int16).reshape(r, k)
    sums = b[..., 0].clone()
    for j in range(1, BLOCK):  # left to right, as the kernel adds them
        sums += b[..., j]
    return q, amax / top, sums


def block_minus(held) -> torch.Tensor:
    """m [N, K / 32] fp32 of a held block weight: each block's weights are d q + m (zero for Q8_0, Q6_K)."""
    n, k = held.shape
    if hasattr(held, "chunks"):  # Q4_K / Q5_K: minus per chunk of 32
        return held.chunks(0, n)[2].neg()
    if hasattr(held, "gguf_parts") and held.fmt in (2, 3, 10, 11):
        return held.gguf_parts(0, n)[2]
    return torch.zeros(n, k // BLOCK)


def int_reference(x: torch.Tensor, held, bias: torch.Tensor | None = None, bits: int = 8) -> torch.Tensor:
    """The integer kernel's result computed by torch in float64: sum over blocks of (w - m) . (q dx) + m sum(x),
    w the weights the blocks rebuild (unpack), q, dx and the sums as quantize_rows gives them -> [R, N] fp32."""
    q, dx, sums = quantize_rows(x, bits)
    r, k = x.shape
    w, m = held.unpack().double(), block_minus(held).double()  # [N, K], [N, K / 32]
    xh = (q.double().view(r, -1, BLOCK) * dx.double()[..., None]).view(r, k)
    y = xh @ (w - m.repeat_interleave(BLOCK, dim=1)).T + sums.double() @ m.T
    return (y + bias.double() if bias is not None else y).float()


def int_error_bound(x: torch.Tensor, held, bits: int = 8) -> torch.Tensor:
    """[R, N]: a bound on |integer kernel's result - exact fp32 product| from the activations' rounding, sum over
    blocks of (dx / 2) sum |w - m|, plus float32 rounding of sums of |w x| (the tests' tolerance)."""
    _, dx, _ = quantize_rows(x, bits)
    r, k = x.shape
    w, m = held.unpack().double(), block_minus(held).double()
    dq = (w - m.repeat_interleave(BLOCK, dim=1)).abs().view(-1, k // BLOCK, BLOCK).sum(-1)  # [N, K / 32]
    rounding = x.double().abs() @ w.abs().T * (k * 2.0 ** -23)
    return (dx.double() / 2) @ dq.T + rounding
