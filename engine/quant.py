"""The guide's math: 1/2-bit KIVI quantization of K and V, bit packing, and scoring
kernels that read the packed codes.

Quantization (KIVI layout, see /work/shared/design/specache-algorithm.md):

- keys per channel: a group is ``g`` consecutive TOKENS of one channel;
- values per token: a group is ``g`` consecutive CHANNELS of one token;
- 2 bit (plain KIVI): z = min, s = (max - min) / 3, q = clamp(round((x - z) / s), 0, 3);
- 1 bit (the paper's modified KIVI): z = (3 min + max) / 4, s = (max - min) / 2,
  q = clamp(round((x - z) / s), 0, 1), so reconstructions sit at min + range/4 and
  min + 3 range/4;
- x' = q * s + z. Scale and zero are stored in fp16; they are rounded to fp16 *before*
  the codes are chosen, so the codes are optimal for the stored parameters. A constant
  group (s == 0 after rounding) divides by 1 instead and reconstructs to z.

Bit packing (``pack_codes``), along the last axis, in runs of 8 codes, LSB first:

- 1 bit: byte ``p`` holds codes ``8p .. 8p+7``; bit ``i`` is code ``8p+i``;
- 2 bit: bit planes per run of 8 codes: byte ``2p`` holds the low bits of codes
  ``8p .. 8p+7`` (bit ``i`` = code ``8p+i``), byte ``2p+1`` their high bits. Read as a
  little-endian uint16, word ``p`` has the low plane in bits 0-7 and the high plane in
  bits 8-15.

So every 16-bit word holds 16 (1 bit) or 8 (2 bit) whole codes, which the torch kernels
expand with one 65536-entry table lookup per word, and a SIMD kernel can use bytes as
lane masks directly (a masked add per plane).

Storage layouts (capacity ``Lc`` tokens, a multiple of ``g`` for keys):

- keys: ``codes`` uint8 ``[B, H, Lc/g, D, g*bits/8]``: per token group and channel, the
  group's ``g`` tokens packed along tokens ("token-packed"). Unpacked, a group is a
  contiguous ``[D, g]`` matrix, i.e. K^T of that group, ready for ``q @ K^T``.
  ``scale``/``zero`` fp16 ``[B, H, Lc/g, D]``. Keys are quantized in whole groups, so the
  number of quantized key tokens ``n`` is always a multiple of ``g`` (the engine keeps
  the tail in its exact residual window).
- values: ``codes`` uint8 ``[B, H, Lc, D*bits/8]`` (channel-packed per token),
  ``scale``/``zero`` fp16 ``[B, H, Lc, D/g]``. Any ``n`` is allowed.

The kernels ``guide_scores`` (q @ K^T) and ``guide_weighted_values`` (p @ V) never build a
dequantized copy of the guide: they expand the codes (as centred odd integers 2c - 3 ..
3, exact in fp32 and bf16) with a table lookup, fold the per-group scale into the query
(keys) or the probabilities (values), and the zero point into one small matmul. ``*_reference`` functions do dequantize-then-matmul, for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
import torch.nn.functional as F

__all__ = [
    "QuantizedKeys",
    "QuantizedValues",
    "pack_codes",
    "unpack_codes",
    "quantize_keys",
    "quantize_values",
    "quantize_keys_into",
    "quantize_values_into",
    "empty_keys",
    "empty_values",
    "dequantize_keys",
    "dequantize_values",
    "guide_scores",
    "guide_scores_reference",
    "guide_weighted_values",
    "guide_weighted_values_reference",
    "guide_bits_per_element",
    "tensor_bytes",
]

_BITS = (1, 2)


def _check_bits(bits: int) -> None:
    if bits not in _BITS:
        raise ValueError(f"bits must be 1 or 2, got {bits}")


# ----------------------------------------------------------------------------- packing


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack codes (uint8 [..., N], values < 2**bits, N % 8 == 0) into uint8 [..., N*bits/8].

    Layout: see the module docstring (runs of 8 codes, LSB first; 2 bit as two bit planes).
    """
    _check_bits(bits)
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"the packed axis must be a multiple of 8, got {n}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], n // 8, 8)  # [..., N/8, 8]
    planes = []
    for plane in range(bits):
        cp = (c >> plane) & 1 if bits > 1 else c
        out = cp[..., 0].clone()  # [..., N/8]
        for i in range(1, 8):
            out |= cp[..., i] << i
        planes.append(out)
    if bits == 1:
        return planes[0]
    return torch.stack(planes, dim=-1).reshape(*codes.shape[:-1], n // 4)  # [..., N/4]


def unpack_codes(packed: Tensor, bits: int, n: int | None = None) -> Tensor:
    """Inverse of ``pack_codes``: uint8 [..., M] -> uint8 codes [..., n] (n <= M*8/bits)."""
    _check_bits(bits)
    m = packed.shape[-1]
    total = m * 8 // bits
    if n is None:
        n = total
    if n > total:
        raise ValueError(f"asked for {n} codes, packed axis holds {total}")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    if bits == 1:
        c = (packed.unsqueeze(-1) >> shifts) & 1  # [..., M, 8]
    else:
        p = packed.reshape(*packed.shape[:-1], m // 2, 2)  # [..., M/2, 2 planes]
        lo = (p[..., 0:1] >> shifts) & 1  # [..., M/2, 8]
        hi = (p[..., 1:2] >> shifts) & 1
        c = lo | (hi << 1)
    return c.reshape(*packed.shape[:-1], total)[..., :n]


@functools.lru_cache(maxsize=16)
def _word_table(bits: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Read-only constant: uint16 word -> its centred codes, [65536, 16/bits] in ``dtype``."""
    w = torch.arange(65536, dtype=torch.int32, device=device)[:, None]
    i = torch.arange(8 if bits == 2 else 16, dtype=torch.int32, device=device)
    if bits == 1:
        t = (w >> i) & 1
    else:
        t = ((w >> i) & 1) | (((w >> (i + 8)) & 1) << 1)
    return (2 * t - ((1 << bits) - 1)).to(dtype)  # centred codes 2c - (2^b - 1)


@functools.lru_cache(maxsize=16)
def _byte_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """Read-only constant: byte -> its 8 centred one-bit codes (-1/+1), [256, 8] in ``dtype``."""
    w = torch.arange(256, dtype=torch.int32, device=device)[:, None]
    return (2 * ((w >> torch.arange(8, dtype=torch.int32, device=device)) & 1) - 1).to(dtype)


def _expand_codes(packed: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """Packed uint8 [..., M] -> centred codes 2c - (2^b - 1) as ``dtype`` [..., M*8/bits].

    Centred codes are odd integers (exact in any float type) and make the code term and
    the zero term of the kernels cancel less, which matters for bfloat16.
    """
    m = packed.shape[-1]
    lead = packed.shape[:-1]
    if m % 2 == 0:
        try:  # no copy when strides allow (buffer prefixes do)
            words = packed.view(torch.uint16)  # [..., M/2]
        except RuntimeError:
            words = packed.contiguous().view(torch.uint16)
        words = words.to(torch.int32)
        out = F.embedding(words, _word_table(bits, dtype, packed.device))  # [..., M/2, 16/b]
    else:  # only 1 bit can have an odd byte count
        out = F.embedding(packed.to(torch.int32), _byte_table(dtype, packed.device))
    return out.reshape(*lead, m * 8 // bits)


# ------------------------------------------------------------------------ quantization


def _params(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Group min/max (fp32) -> (scale, zero) rounded to fp16."""
    rng = hi - lo
    if bits == 2:
        s, z = rng / 3, lo
    else:
        s, z = rng / 2, lo + rng / 4  # = (3 min + max) / 4
    return s.to(torch.float16), z.to(torch.float16)


def _centred(s16: Tensor, z16: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """fp32 (scale, zero) for centred codes: s c + z = (s/2)(2c - m) + (z + s m/2), m = 2^b - 1."""
    s = s16.float()
    m = (1 << bits) - 1
    return s * 0.5, z16.float() + s * (m * 0.5)


def _codes(x: Tensor, s16: Tensor, z16: Tensor, bits: int) -> Tensor:
    """x, s, z broadcastable -> uint8 codes; s == 0 (constant group) is guarded."""
    s = s16.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((x - z16.float()) / s)
    return q.clamp_(0, (1 << bits) - 1).to(torch.uint8)


@dataclass
class QuantizedKeys:
    """Per-channel quantized keys (groups of ``group`` tokens), token-packed codes."""

    codes: Tensor  # uint8 [B, H, Lc/g, D, g*bits/8]
    scale: Tensor  # fp16 [B, H, Lc/g, D]
    zero: Tensor  # fp16 [B, H, Lc/g, D]
    bits: int
    group: int

    @property
    def capacity(self) -> int:
        """Number of token slots (a multiple of ``group``)."""
        return self.codes.shape[2] * self.group

    @property
    def head_dim(self) -> int:
        return self.codes.shape[3]

    def prefix(self, n: int) -> "QuantizedKeys":
        """View of the first ``n`` tokens (n % group == 0)."""
        j = _key_groups(n, self.group, self.capacity)
        return QuantizedKeys(
            self.codes[:, :, :j], self.scale[:, :, :j], self.zero[:, :, :j], self.bits, self.group
        )


@dataclass
class QuantizedValues:
    """Per-token quantized values (groups of ``group`` channels), channel-packed codes."""

    codes: Tensor  # uint8 [B, H, Lc, D*bits/8]
    scale: Tensor  # fp16 [B, H, Lc, D/g]
    zero: Tensor  # fp16 [B, H, Lc, D/g]
    bits: int
    group: int

    @property
    def capacity(self) -> int:
        return self.codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[3] * 8 // self.bits

    def prefix(self, n: int) -> "QuantizedValues":
        """View of the first ``n`` tokens."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"n={n} outside [0, {self.capacity}]")
        return QuantizedValues(
            self.codes[:, :, :n], self.scale[:, :, :n], self.zero[:, :, :n], self.bits, self.group
        )


def _key_groups(n: int, group: int, capacity: int) -> int:
    if n % group or not 0 <= n <= capacity:
        raise ValueError(f"key token count {n} must be a multiple of {group} in [0, {capacity}]")
    return n // group


def empty_keys(
    batch: int, heads: int, capacity: int, head_dim: int, bits: int, group: int,
    device: torch.device | str | None = None,
) -> QuantizedKeys:
    """Zeroed key guide buffer for ``capacity`` tokens (rounded up to a whole group)."""
    _check_bits(bits)
    if group % 8:
        raise ValueError(f"key group must be a multiple of 8, got {group}")
    j = -(-capacity // group)
    return QuantizedKeys(
        codes=torch.zeros(batch, heads, j, head_dim, group * bits // 8, dtype=torch.uint8, device=device),
        scale=torch.zeros(batch, heads, j, head_dim, dtype=torch.float16, device=device),
        zero=torch.zeros(batch, heads, j, head_dim, dtype=torch.float16, device=device),
        bits=bits,
        group=group,
    )


def empty_values(
    batch: int, heads: int, capacity: int, head_dim: int, bits: int, group: int,
    device: torch.device | str | None = None,
) -> QuantizedValues:
    """Zeroed value guide buffer for ``capacity`` tokens."""
    _check_bits(bits)
    if head_dim % group or head_dim % 8:
        raise ValueError(f"head_dim {head_dim} must be a multiple of the group {group} and of 8")
    return QuantizedValues(
        codes=torch.zeros(batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device),
        scale=torch.zeros(batch, heads, capacity, head_dim // group, dtype=torch.float16, device=device),
        zero=torch.zeros(batch, heads, capacity, head_dim // group, dtype=torch.float16, device=device),
        bits=bits,
        group=group,
    )


def _quantize_keys_parts(k: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """k [B, H, T, D] (T % g == 0) -> codes [B, H, T/g, D, g*bits/8], scale, zero [B, H, T/g, D]."""
    b, h, t, d = k.shape
    if t % group:
        raise ValueError(f"key token count {t} is not a multiple of the group {group}")
    x = k.float().reshape(b, h, t // group, group, d).transpose(-1, -2)  # [B, H, J, D, g]
    s16, z16 = _params(x.amin(-1), x.amax(-1), bits)  # [B, H, J, D]
    codes = _codes(x, s16[..., None], z16[..., None], bits)  # [B, H, J, D, g]
    return pack_codes(codes, bits), s16, z16


def _quantize_values_parts(v: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """v [B, H, T, D] (D % g == 0) -> codes [B, H, T, D*bits/8], scale, zero [B, H, T, D/g]."""
    b, h, t, d = v.shape
    if d % group:
        raise ValueError(f"head_dim {d} is not a multiple of the group {group}")
    x = v.float().reshape(b, h, t, d // group, group)  # [B, H, T, D/g, g]
    s16, z16 = _params(x.amin(-1), x.amax(-1), bits)  # [B, H, T, D/g]
    codes = _codes(x, s16[..., None], z16[..., None], bits).reshape(b, h, t, d)
    return pack_codes(codes, bits), s16, z16


def quantize_keys(k: Tensor, bits: int, group: int) -> QuantizedKeys:
    """k [B, H, L, D] with L % group == 0 -> QuantizedKeys holding exactly L tokens."""
    _check_bits(bits)
    if group % 8:
        raise ValueError(f"key group must be a multiple of 8, got {group}")
    codes, s, z = _quantize_keys_parts(k, bits, group)
    return QuantizedKeys(codes, s, z, bits, group)


def quantize_values(v: Tensor, bits: int, group: int) -> QuantizedValues:
    """v [B, H, L, D] with D % group == 0 -> QuantizedValues holding exactly L tokens."""
    _check_bits(bits)
    if v.shape[-1] % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {v.shape[-1]}")
    codes, s, z = _quantize_values_parts(v, bits, group)
    return QuantizedValues(codes, s, z, bits, group)


def quantize_keys_into(dst: QuantizedKeys, k: Tensor, start: int) -> None:
    """Quantize k [B, H, T, D] (T % g == 0) into ``dst`` tokens [start, start+T), start % g == 0."""
    g = dst.group
    if start % g:
        raise ValueError(f"start {start} is not a multiple of the group {g}")
    j0 = start // g
    j1 = _key_groups(start + k.shape[2], g, dst.capacity)
    codes, s, z = _quantize_keys_parts(k, dst.bits, g)
    dst.codes[:, :, j0:j1] = codes
    dst.scale[:, :, j0:j1] = s
    dst.zero[:, :, j0:j1] = z


def quantize_values_into(dst: QuantizedValues, v: Tensor, start: int) -> None:
    """Quantize v [B, H, T, D] into ``dst`` tokens [start, start+T)."""
    end = start + v.shape[2]
    if not 0 <= start <= end <= dst.capacity:
        raise ValueError(f"tokens [{start}, {end}) outside capacity {dst.capacity}")
    codes, s, z = _quantize_values_parts(v, dst.bits, dst.group)
    dst.codes[:, :, start:end] = codes
    dst.scale[:, :, start:end] = s
    dst.zero[:, :, start:end] = z


def dequantize_keys(qk: QuantizedKeys, n: int | None = None) -> Tensor:
    """QuantizedKeys -> fp32 [B, H, n, D] (n defaults to the capacity; n % g == 0)."""
    qk = qk.prefix(qk.capacity if n is None else n)
    b, h, j, d, _ = qk.codes.shape
    c = unpack_codes(qk.codes, qk.bits).float()  # [B, H, J, D, g]
    x = c * qk.scale.float()[..., None] + qk.zero.float()[..., None]
    return x.transpose(-1, -2).reshape(b, h, j * qk.group, d)


def dequantize_values(qv: QuantizedValues, n: int | None = None) -> Tensor:
    """QuantizedValues -> fp32 [B, H, n, D] (n defaults to the capacity)."""
    qv = qv.prefix(qv.capacity if n is None else n)
    b, h, t, _ = qv.codes.shape
    d, g = qv.head_dim, qv.group
    c = unpack_codes(qv.codes, qv.bits).float().reshape(b, h, t, d // g, g)
    x = c * qv.scale.float()[..., None] + qv.zero.float()[..., None]
    return x.reshape(b, h, t, d)


# ---------------------------------------------------------------------------- kernels


def guide_scores(
    q: Tensor, qk: QuantizedKeys, n: int, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """q [B, Hkv, Q, D] @ dequant(K)[:, :, :n]^T -> fp32 [B, Hkv, Q, n] (no 1/sqrt(D)).

    ``n`` must be a multiple of the key group. Within group j, K[l, d] = s[j,d] c[l,d] +
    z[j,d], so scores = (q * s[j]) @ c^T + q @ z[j]^T: the codes are expanded as exact
    small integers in ``dtype`` (float32: exact; bfloat16: faster on CPUs with bf16 dot
    products, ~1e-3 relative error) and the scale is folded into the query.
    """
    b, h, nq, d = q.shape
    g = qk.group
    j = _key_groups(n, g, qk.capacity)
    if j == 0:
        return q.new_zeros(b, h, nq, 0, dtype=torch.float32)
    qf = q.float()
    s, z = _centred(qk.scale[:, :, :j], qk.zero[:, :, :j], qk.bits)  # [B, H, J, D] each
    c = _expand_codes(qk.codes[:, :, :j], qk.bits, dtype)  # [B, H, J, D, g]
    qs = (qf[:, :, None] * s[:, :, :, None]).to(dtype)  # [B, H, J, Q, D]
    zq = torch.matmul(z, qf.transpose(-1, -2))  # [B, H, J, Q]
    sc = torch.matmul(qs, c)  # [B, H, J, Q, g]
    if dtype != torch.float32:
        sc = sc.float()
    sc = sc + zq[..., None]  # [B, H, J, Q, g]
    return sc.permute(0, 1, 3, 2, 4).reshape(b, h, nq, n)


def guide_scores_reference(q: Tensor, qk: QuantizedKeys, n: int) -> Tensor:
    """Dequantize-then-matmul version of ``guide_scores`` (for tests): fp32 [B, Hkv, Q, n]."""
    return torch.matmul(q.float(), dequantize_keys(qk, n).transpose(-1, -2))


def guide_weighted_values(
    p: Tensor, qv: QuantizedValues, n: int, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """p [B, Hkv, Q, n] @ dequant(V)[:, :, :n] -> fp32 [B, Hkv, Q, D].

    Per token l and channel group j: V[l, d] = s[l,j] c[l,d] + z[l,j], so
    p @ V[:, group j] = (p * s[:, j]) @ c[:, group j] + (p @ z[:, j]) broadcast over the
    group's channels. ``dtype`` as in ``guide_scores``.
    """
    b, h, nq, _ = p.shape
    d, g = qv.head_dim, qv.group
    qv = qv.prefix(n)
    if p.shape[-1] != n:
        raise ValueError(f"p has {p.shape[-1]} columns, expected n={n}")
    pf = p.float()
    if n == 0:
        return pf.new_zeros(b, h, nq, d)
    s, z = _centred(qv.scale, qv.zero, qv.bits)  # [B, H, n, D/g] each
    c = _expand_codes(qv.codes, qv.bits, dtype)  # [B, H, n, D]
    out = torch.matmul(pf, z).repeat_interleave(g, dim=-1)  # [B, H, Q, D]
    for jv in range(d // g):
        ps = (pf * s[:, :, None, :, jv]).to(dtype)  # [B, H, Q, n]
        part = torch.matmul(ps, c[..., jv * g : (jv + 1) * g])  # [B, H, Q, g]
        out[..., jv * g : (jv + 1) * g] += part.float()
    return out


def guide_weighted_values_reference(p: Tensor, qv: QuantizedValues, n: int) -> Tensor:
    """Dequantize-then-matmul version of ``guide_weighted_values``: fp32 [B, Hkv, Q, D]."""
    return torch.matmul(p.float(), dequantize_values(qv, n))


# ---------------------------------------------------------------------------- storage


def guide_bits_per_element(bits: int, group: int) -> float:
    """Storage per element: ``bits`` of code plus fp16 scale and zero per ``group``."""
    return bits + 32 / group


def tensor_bytes(q: QuantizedKeys | QuantizedValues) -> int:
    """Actual storage bytes of codes + scale + zero."""
    return sum(t.numel() * t.element_size() for t in (q.codes, q.scale, q.zero))
