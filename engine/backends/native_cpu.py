"""The CPU's backend: the native library (engine/native, C built at first use) behind the Kernels contract.
Every pointer and ctypes structure the engine hands to C is made here; a hook declines (None / False) where
the library is missing or the inputs are not the layout its C reads, and the caller's torch reference runs."""
from __future__ import annotations

import ctypes

import torch

from engine import native
from engine.backends.kernels import Kernels, register
from engine.backends.native_fused import STORE_DTYPES, FusedDecode

BLOCK = 32

# The choices this backend declares for the machine it runs on (read by engine.model.decode_kernels and
# engine.kvcache.passes).
# The native library's instruction set -> the decode kernel taken by default. int16 on x86 (AVX-512, AVX2): on
# Gemma 3 270M Q4_K_M its 64 greedy tokens were the exact kernel's on all six windows checked (three documents,
# start and end; bench-results/decode-kernels.md), and per weight it ran 1.1-2.0x the exact kernel's speed
# on Zen 4 at both levels (scripts/bench_decode_kernels.py). int8 stays opt-in: its tokens left the exact ones
# after 6-25 tokens on five of those six windows (Gemma's outlier channels). NEON keeps exact: int16 is not measured
# there yet. $SPECACHE_DECODE_LINEAR=exact gives the de-quantized fp32 model's products bit for bit.
DECODE_LINEAR_BY_ISA = {"avx512": "int16", "avx2": "int16", "neon": "exact", "generic": "exact", "torch": "exact"}


def default_decode_linear() -> str:
    """The decode kernel a GGUF's held weights take unless asked otherwise: DECODE_LINEAR_BY_ISA's for the native
    library's instruction set ("exact" without the library)."""
    return DECODE_LINEAR_BY_ISA.get(native.isa(), "exact")


# The code of a bf16 prefill chunk's attention (prepare_model's prefill dtype: where the CPU has native bf16), by
# what the CPU has, first match: "torch", torch's flash kernel on bf16 Q, K and V, which runs on AMX tiles (Sapphire
# Rapids, 2 threads, 4 query heads x 512 tokens over 1,023 keys of 256 channels: 2.1-2.5 ms, the native kernel 6.7 ms
# with a window of 512, 9.1 without); "native", the AVX512-BF16 kernel (prefill_attention below; Zen 4, no AMX:
# torch's flash kernel computes in fp32 there, the native one ~4x its rate). Elsewhere None: the exact fp32 path.
BF16_PREFILL_KERNELS = (("amx_bf16", "torch"), ("avx512_bf16", "native"))


def bf16_prefill_kernel() -> str | None:
    """Which code computes a bf16 prefill chunk's attention on this CPU (BF16_PREFILL_KERNELS): "torch", "native"
    or None."""
    flags = native.cpu_flags()
    return next((kernel for flag, kernel in BF16_PREFILL_KERNELS if flag in flags), None)


def inner_contiguous(t: torch.Tensor, dim: int) -> bool:
    """True when dims [dim:] of t are laid out contiguously (strides of size-1 dims do not matter)."""
    if t.is_contiguous():  # the usual case: a batch-row slice of a guide buffer
        return True
    expected = 1
    for size, stride in reversed(list(zip(t.shape[dim:], t.stride()[dim:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def native_guide(kernel: str, x: torch.Tensor, qg, n: int, groups: int, width: int):
    """One of the native guide kernels (`kernel`: its C name) over x [B, H, Q, *] and the guide qg (codes, scale,
    zero, head_dim, group, bits, code_tail: the codes' shape after [B, H, blocks]): fp32 [B, H, Q, width], or
    None when the library is unavailable or the layout does not apply (groups: the scale's last dim)."""
    lib = native.lib()
    if lib is None:
        return None
    b, h, nq, _ = x.shape
    d, g, bits = qg.head_dim, qg.group, qg.bits
    codes, scale, zero = qg.codes, qg.scale, qg.zero
    if (codes.dtype != torch.uint8 or scale.dtype != torch.float16 or zero.dtype != torch.float16
            or codes.device.type != "cpu" or codes.shape[:2] != (b, h) or codes.shape[3:] != qg.code_tail
            or scale.shape[3] != groups or zero.shape != scale.shape or zero.stride() != scale.stride()
            or not inner_contiguous(codes, 2) or not inner_contiguous(scale, 2)):
        return None
    xf = x if x.dtype == torch.float32 else x.float()
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    out = torch.empty(b, h, nq, width, dtype=torch.float32)
    rc = getattr(lib, kernel)(
        xf.data_ptr(), xf.stride(0), xf.stride(1), xf.stride(2),
        codes.data_ptr(), codes.stride(0), codes.stride(1), scale.data_ptr(), zero.data_ptr(),
        scale.stride(0), scale.stride(1), out.data_ptr(), b, h, nq, d, n, g, bits, native.threads())
    return out if rc == 0 else None


class DecodeCall:
    """x [..., K] (1-8 rows, fp32, contiguous) @ W^T (+ bias) by one native kernel on a held block weight,
    with the kernel, the weight's pointer, format and shape and the bias bound once: a decode step makes
    ~130 (Gemma 3 270M) to ~210 (SmolLM2) of these calls. bits: the integer kernel's activation width (8, 16),
    None for the exact kernel. Returns None where it does not apply (the caller's general path then runs)."""

    __slots__ = ("fn", "fixed", "bias", "n", "k", "held", "tail")

    def __init__(self, held, bias: torch.Tensor | None, bits: int | None):
        lib = native.lib()
        self.held = held  # kept alive with the pointer bound below
        self.fn = lib.specache_int8_linear if bits else lib.specache_packed_linear
        self.tail = (bits,) if bits else ()
        self.n, self.k = held.shape
        self.fixed = (held.data.data_ptr(), held.fmt, self.n, self.k)
        self.bias = bias.data_ptr() if bias is not None else None

    @property
    def kernel(self) -> str:
        """The kernel's name: "exact", "int8" or "int16" (engine.model.decode_kernels.CHOICES)."""
        return f"int{self.tail[0]}" if self.tail else "exact"

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.numel() // self.k
        if not 0 < rows <= 8 or x.shape[-1] != self.k or x.dtype != torch.float32 or not x.is_contiguous():
            return None
        y = torch.empty(*x.shape[:-1], self.n)
        rc = self.fn(x.data_ptr(), self.k, rows, *self.fixed, self.bias, y.data_ptr(), self.n, native.threads(),
                     *self.tail)
        return y if rc == 0 else None


class PackedCall:
    """x [R <= 8, K] fp32 (rows contiguous along K) @ W^T (+ bias) by the exact native kernel on a packed
    weight's bytes, the kernel and the weight's pointer, format and shape bound once."""

    __slots__ = ("fn", "fixed", "data")

    def __init__(self, data: torch.Tensor, fmt: int, shape: tuple[int, int]):
        self.fn, self.data = native.lib().specache_packed_linear, data  # data: kept alive with its pointer
        self.fixed = (data.data_ptr(), fmt, shape[0], shape[1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        rows, n = x.shape[0], self.fixed[2]
        y = torch.empty(rows, n, dtype=torch.float32)
        rc = self.fn(x.data_ptr(), x.stride(0), rows, *self.fixed, bias.data_ptr() if bias is not None else None,
                     y.data_ptr(), n, native.threads())
        return y if rc == 0 else None


@register
class NativeCPU(Kernels):
    """engine/native's C kernels (guide_kernels.c, attention_kernels.c, norm_kernels.c, linear_kernels.c,
    int8_linear.c, pack_kernels.c)."""

    name = "native"
    devices = ("cpu",)

    @classmethod
    def available(cls) -> bool:
        return native.lib() is not None

    def guide_scores(self, q, keys, n):
        d = q.shape[-1]
        if d % 8 or d > 1024 or keys.head_dim != d:
            return None
        return native_guide("specache_guide_scores", q, keys, n, d, n)

    def guide_values(self, p, values, n):
        d = values.head_dim
        return native_guide("specache_guide_weighted_values", p, values, n, d // values.group, d)

    def sliding_attention(self, layer, qg, scaling, step, softcap):
        """qg [b, H_kv, G*T, D] fp32 (rows contiguous) over the ring of `layer` (k, v, pos, window, shape.group)
        for the rows step.rows, each row's first new position step.start -> [b, H_kv, G*T, D]."""
        if native.lib() is None:
            return None
        start = step.start.to(torch.long).contiguous()
        b, h, nq, d = qg.shape
        out = torch.empty(b, h, nq, d, dtype=torch.float32)
        k, v, pos = layer.k, layer.v, layer.pos
        a = native.SlidingArgs(B=b, H=h, G=layer.shape.group, T=step.n_new, D=d, C=k.shape[2], W=layer.window,
                               row0=step.rows.start, nthreads=native.threads(), scaling=scaling,
                               softcap=softcap or 0.0, q=qg.data_ptr(), q_sb=qg.stride(0), q_sh=qg.stride(1),
                               k=k.data_ptr(), v=v.data_ptr(), k_sb=k.stride(0), k_sh=k.stride(1), pos=pos.data_ptr(),
                               pos_sb=pos.stride(0), start=start.data_ptr(), out=out.data_ptr())
        rc = native.lib().specache_sliding_attention(ctypes.byref(a))
        if rc != 0:
            raise RuntimeError(f"native sliding-window attention failed (rc {rc})")
        return out

    def prefill_attention(self, qg, pieces, scaling, start, first, window):
        """qg [1, H_kv, G*T, D] fp32 contiguous, pieces (k, v) [1, H_kv, n_i, D] holding positions
        first..start+T-1 (engine.kvcache.passes.bf16_prefill_attention checks them) -> [1, H_kv, G*T, D]."""
        lib = native.lib()
        if lib is None or not lib.specache_prefill_attention_available():
            return None
        hk, d = qg.shape[1], qg.shape[3]
        t = sum(k.shape[2] for k, _ in pieces) - (start - first)  # the pieces hold first..start+T-1
        dtype = pieces[0][0].dtype
        out = torch.empty_like(qg)
        args = native.PrefillArgs(H=hk, G=qg.shape[2] // t, T=t, D=d, start=start, npieces=len(pieces),
                                  src_bf16=int(dtype == torch.bfloat16), nthreads=native.threads(), first=first,
                                  window=window, scaling=scaling, q=qg.data_ptr(), q_sh=qg.stride(1),
                                  out=out.data_ptr())
        for i, (k, v) in enumerate(pieces):
            args.k[i], args.v[i] = k.data_ptr(), v.data_ptr()
            args.n[i], args.sr[i], args.sh[i] = k.shape[2], k.stride(2), k.stride(1)
        return out if lib.specache_prefill_attention(args) == 0 else None

    def rms_norm(self, x, scale, eps, res):
        lib = native.lib()
        if lib is None or scale.dtype != torch.float32 or not scale.is_contiguous():
            return None
        if res is not None and (res.shape != x.shape or res.dtype != torch.float32 or not res.is_contiguous()):
            return None
        n = x.shape[-1]
        out = torch.empty_like(x)
        rc = lib.specache_rms_norm(x.data_ptr(), scale.data_ptr(), None if res is None else res.data_ptr(),
                                   out.data_ptr(), x.numel() // n, n, eps)
        return out if rc == 0 else None

    def norm_rope(self, parts, head_dim, eps, cos, sin):
        lib = native.lib()
        if lib is None:
            return False
        b, t = parts[0][0].shape[0], parts[0][0].shape[1]
        cs_rows = cos.shape[0] * t
        for y, scale in parts:
            rc = lib.specache_norm_rope(y.data_ptr(), b * t, y.shape[-1] // head_dim, head_dim,
                                        None if scale is None else scale.data_ptr(), eps, cos.data_ptr(),
                                        sin.data_ptr(), cs_rows)
            if rc != 0:
                raise RuntimeError(f"native norm and rope failed (rc {rc})")
        return True

    def linear(self, x, weight, bias):
        lib = native.lib()
        if lib is None:
            return None
        rows, k = x.shape
        n = weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        rc = lib.specache_skinny_linear(x.data_ptr(), x.stride(0), rows, weight.data_ptr(), n, k,
                                        bias.data_ptr() if bias is not None else None, y.data_ptr(), n,
                                        native.threads())
        return y if rc == 0 else None

    def bind_linear(self, held, bias, bits):
        return DecodeCall(held, bias, bits) if native.lib() is not None else None

    def bind_packed(self, data, fmt, shape):
        return PackedCall(data, fmt, shape) if native.lib() is not None else None

    def unpack_rows(self, data, fmt, n0, n1, k, dtype):
        lib = native.lib()
        if lib is None:
            return None
        out = torch.empty(n1 - n0, k, dtype=dtype)
        rc = lib.specache_unpack(data.data_ptr(), fmt, n0, n1, k, out.data_ptr(), int(dtype == torch.bfloat16),
                                 native.threads())
        if rc != 0:
            raise RuntimeError(f"specache_unpack: rc {rc}")
        return out

    def fused_takes(self, layer, q, step) -> bool:
        """An eager pass (not a recorded one) of fp32 queries on the CPU, the residual fp32, the store fp32 or bf16."""
        return (not step.fixed and q.device.type == "cpu" and q.dtype == torch.float32
                and layer.res_k.dtype == torch.float32 and layer.store.k.dtype in STORE_DTYPES)

    def fused_decode(self, layer):
        return FusedDecode(layer) if native.lib() is not None else None

    def pack_weight(self, weight, record_bytes):
        lib = native.lib()
        if lib is None:
            return None
        n, k = weight.shape
        for fmt, packer in ((4, lib.specache_pack_affine4), (8, lib.specache_pack_scaled8)):
            data = torch.empty(n, k // BLOCK * record_bytes[fmt], dtype=torch.uint8)
            if packer(weight.data_ptr(), n, k, data.data_ptr()) == 0:
                return fmt, data
        return None

