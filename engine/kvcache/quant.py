"""The guide's math: 1/2-bit KIVI quantization of K and V, bit packing, and kernels that
read the packed codes. Quantization, packing and the storage layouts are in engine/kvcache/codes.py
(re-exported here); this module holds the kernels.

The kernels ``guide_scores`` (q @ K^T) and ``guide_weighted_values`` (p @ V) never build a
dequantized copy of the guide: per group, K = s * c + z, so q @ K^T = (q * s) @ c^T +
q @ z^T, with c the expanded codes (exact small integers) and s folded into the query
(keys) or the probabilities (values).

The device's backend (engine.backends.kernels: its guide_scores / guide_values hooks) computes them where it
takes the call: on a CPU the native code of ``engine.native`` (C, engine/native/guide_kernels.c: 4-bit
lookup tables with the queries in SIMD lanes, fp32 throughout) when it can be built and ``$SPECACHE_NATIVE``
is not 0; one thread unless ``$SPECACHE_NATIVE_THREADS`` says otherwise. It reads this same layout (it
gathers a token's channel bits, or a channel's token bits, with a few SIMD instructions). On CUDA the
Triton kernels of engine/backends/triton_guide.py read the same layout in one launch each (guide_kernel
names the code a device gets). Otherwise the torch code below, the hooks' reference, expands the codes in
cache-sized chunks and multiplies. The ``*_reference`` functions dequantize then matmul, for tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.backends.kernels import backend_for
from engine.kvcache import codes
from engine.kvcache.codes import (
    _VR,
    VALUE_BLOCK,
    QuantizedKeys,
    QuantizedValues,
    _bit_masks,
    _key_groups,
    _slice_weights,
    dequantize_keys,
    dequantize_values,
    empty_keys,
    empty_values,
    guide_bits_per_element,
    pack_codes,
    quantize_keys,
    quantize_keys_into,
    quantize_values,
    quantize_values_into,
    unpack_codes,
)

__all__ = [
    *codes.__all__,
    "guide_scores",
    "guide_scores_reference",
    "guide_weighted_values",
    "guide_weighted_values_reference",
    "tensor_bytes",
]

# Codes are expanded in chunks of about this many bytes: on a CPU so that they are still
# in cache when the matmul reads them; on an accelerator only to bound the scratch memory.
_CHUNK_BYTES = 2 << 20
_CHUNK_BYTES_ACCEL = 256 << 20


# ---------------------------------------------------------------------------- kernels


def _chunk(total: int, bytes_per_item: int, device: torch.device) -> int:
    """Items per chunk of expanded codes (see ``_CHUNK_BYTES``), at most ~64 chunks."""
    limit = _CHUNK_BYTES if device.type == "cpu" else _CHUNK_BYTES_ACCEL
    step = max(limit // max(bytes_per_item, 1), -(-total // 64), 1)
    return min(total, step) if total else 1


def guide_scores(
    q: Tensor, qk: QuantizedKeys, n: int, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """q [B, Hkv, Q, D] @ dequant(K)[:, :, :n]^T -> fp32 [B, Hkv, Q, n] (no 1/sqrt(D)).

    ``n`` must be a multiple of the key group. Within group j, K[l, d] = s[j,d] c[l,d] +
    z[j,d], so scores = (q * s[j]) @ c^T + q @ z[j]^T. The native kernels compute in fp32
    and ignore ``dtype``. In the torch path ``dtype`` is the type of the
    expanded codes and of the matmul: float32 matches the reference to float rounding;
    bfloat16 (bf16 products and bf16-rounded partial sums) errs by up to ~1% of the largest
    |score|, still well below the guide's own quantization error; on this CPU it was only
    0-20% faster.
    """
    b, h, nq, d = q.shape
    j = _key_groups(n, qk.group, qk.capacity)
    if j == 0:
        return q.new_zeros(b, h, nq, 0, dtype=torch.float32)
    out = backend_for(q.device).guide_scores(q, qk, n)
    return out if out is not None else _torch_scores(q, qk, n, dtype)


def _torch_scores(q: Tensor, qk: QuantizedKeys, n: int, dtype: torch.dtype) -> Tensor:
    """The torch path of ``guide_scores`` (any device; n > 0, a multiple of the group)."""
    b, h, nq, d = q.shape
    g, bits = qk.group, qk.bits
    j = n // g
    qf = q.float()
    ng = b * h * j
    s = qk.scale[:, :, :j].float()  # [B, H, J, D]
    qs = (qf[:, :, None] * s[:, :, :, None]).to(dtype).reshape(ng, nq, d)  # [G=BHJ, Q, D]
    zq = torch.matmul(qk.zero[:, :, :j].float(), qf.transpose(-1, -2))  # [B, H, J, Q]
    codes = qk.codes[:, :, :j].reshape(ng, bits, 1, g // 8, d)  # [G, bits, 1, g/8, D]
    masks = _bit_masks(q.device)
    sc = torch.empty(ng, nq, bits * g, dtype=dtype, device=q.device)  # [G, Q, bits*g]
    step = _chunk(ng, bits * g * d * (1 + torch.finfo(dtype).bits // 8), q.device)
    su8 = torch.empty(step, bits, 8, g // 8, d, dtype=torch.uint8, device=q.device)
    sfl = torch.empty(step, bits, 8, g // 8, d, dtype=dtype, device=q.device)
    for c0 in range(0, ng, step):
        c1 = min(ng, c0 + step)
        m = c1 - c0
        torch.bitwise_and(codes[c0:c1], masks, out=su8[:m])  # bit i of row r -> token i*g/8 + r
        e = sfl[:m].copy_(su8[:m]).view(m, bits * g, d)  # [G', (plane, token), D], {0, 2**i}
        torch.bmm(qs[c0:c1], e.transpose(1, 2), out=sc[c0:c1])  # [G', Q, bits*g]
    if bits == 2:  # low plane + 2 * high plane
        sc = torch.add(sc[..., :g], sc[..., g:], alpha=2)  # [G, Q, g]
    out = torch.empty(b, h, nq, j, g, dtype=torch.float32, device=q.device)
    w = _slice_weights(g // 8, q.device)  # [g]
    torch.addcmul(zq.transpose(-1, -2)[..., None], sc.view(b, h, j, nq, g).transpose(2, 3), w, out=out)
    return out.view(b, h, nq, n)


def guide_scores_reference(q: Tensor, qk: QuantizedKeys, n: int) -> Tensor:
    """Dequantize-then-matmul version of ``guide_scores`` (for tests): fp32 [B, Hkv, Q, n]."""
    return torch.matmul(q.float(), dequantize_keys(qk, n).transpose(-1, -2))


def guide_weighted_values(
    p: Tensor, qv: QuantizedValues, n: int, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """p [B, Hkv, Q, n] @ dequant(V)[:, :, :n] -> fp32 [B, Hkv, Q, D].

    Per token l and channel group j: V[l, d] = s[l,j] c[l,d] + z[l,j], so
    p @ V[:, group j] = (p * s[:, j]) @ c[:, group j] + (p @ z[:, j]) broadcast over the
    group's channels. Partial sums are accumulated in fp32; ``dtype`` as in ``guide_scores``.
    """
    b, h, nq, _ = p.shape
    d = qv.head_dim
    if not 0 <= n <= qv.capacity:
        raise ValueError(f"n={n} outside [0, {qv.capacity}]")
    if p.shape[-1] != n:
        raise ValueError(f"p has {p.shape[-1]} columns, expected n={n}")
    if n == 0:
        return p.new_zeros(b, h, nq, d, dtype=torch.float32)
    out = backend_for(p.device).guide_values(p, qv, n)  # (reads the first n tokens of the full buffers)
    return out if out is not None else _torch_weighted_values(p, qv, n, dtype)


def _torch_weighted_values(p: Tensor, qv: QuantizedValues, n: int, dtype: torch.dtype) -> Tensor:
    """The torch path of ``guide_weighted_values`` (any device; 0 < n <= capacity)."""
    b, h, nq, _ = p.shape
    d, g, bits = qv.head_dim, qv.group, qv.bits
    jv = d // g
    qv = qv.prefix(n)
    pf = p.float()
    bh, nb = b * h, qv.codes.shape[2]
    zt = torch.matmul(qv.zero.float().transpose(-1, -2).contiguous(), pf.transpose(-1, -2))  # [B, H, D/g, Q]
    w = _slice_weights(_VR, p.device).expand(nb, VALUE_BLOCK).reshape(-1)[:n]  # [n] = 2**-i(token)
    sw = torch.empty(b, h, jv, n, dtype=torch.float32, device=p.device)
    torch.mul(qv.scale.float().transpose(-1, -2), w, out=sw)  # [B, H, D/g, n]
    # one row per (channel group, query): ps[(j, q), l] = p[q, l] * s[l, j] * 2**-i(l)
    ps = (sw[:, :, :, None] * pf[:, :, None]).to(dtype).reshape(bh, jv * nq, n)  # [BH, (D/g)Q, n]
    codes = qv.codes.reshape(bh, nb, bits, 1, _VR, d)  # [BH, nb, bits, 1, 8, D]
    masks = _bit_masks(p.device)
    acc = torch.zeros(bh, jv * nq, d, dtype=torch.float32, device=p.device)  # [BH, (D/g)Q, D]
    step = _chunk(nb, bh * bits * VALUE_BLOCK * d * (1 + torch.finfo(dtype).bits // 8), p.device)
    su8 = torch.empty(bh, bits, step, 8, _VR, d, dtype=torch.uint8, device=p.device)
    sfl = torch.empty(bh, bits, step, 8, _VR, d, dtype=dtype, device=p.device)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        m = b1 - b0
        # planes before blocks, so that each plane's tokens are one [m*64, D] matrix per row
        torch.bitwise_and(codes[:, b0:b1], masks, out=su8[:, :, :m].transpose(1, 2))
        e = sfl[:, :, :m].copy_(su8[:, :, :m]).view(bh, bits, m * VALUE_BLOCK, d)
        t0, t1 = b0 * VALUE_BLOCK, min(n, b1 * VALUE_BLOCK)  # the last block may be partial
        a = ps[:, :, t0:t1]  # [BH, (D/g)Q, t1-t0]
        for k in range(bits):
            c = e[:, k, : t1 - t0]  # [BH, t1-t0, D]
            if dtype == torch.float32:
                acc.baddbmm_(a, c, alpha=1 << k)
            else:
                acc.add_(torch.bmm(a, c), alpha=1 << k)
    # keep the diagonal blocks: rows of group j times columns of group j
    acc = torch.diagonal(acc.view(b, h, jv, nq, jv, g), dim1=2, dim2=4)  # [B, H, Q, g, D/g]
    return (acc.transpose(-1, -2) + zt.transpose(-1, -2)[..., None]).reshape(b, h, nq, d)


def guide_weighted_values_reference(p: Tensor, qv: QuantizedValues, n: int) -> Tensor:
    """Dequantize-then-matmul version of ``guide_weighted_values``: fp32 [B, Hkv, Q, D]."""
    return torch.matmul(p.float(), dequantize_values(qv, n))


def guide_kernel(device: torch.device) -> str:
    """Which code computes the guide's scores and weighted values on this device: its backend's name ("native"
    on a CPU, "triton" on CUDA) where that runs them, else "torch" (no native library, no Triton, a failed
    launch, or another device)."""
    backend = backend_for(device)
    return backend.name if backend.runs("guide_scores") else "torch"


# ---------------------------------------------------------------------------- storage


def tensor_bytes(q: QuantizedKeys | QuantizedValues) -> int:
    """Actual storage bytes of codes + scale + zero."""
    return sum(t.numel() * t.element_size() for t in (q.codes, q.scale, q.zero))
