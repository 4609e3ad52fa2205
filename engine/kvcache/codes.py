"""The guide's codes: 1/2-bit KIVI quantization of K and V, bit packing and the storage layouts
(engine/kvcache/quant.py holds the kernels that read them and re-exports all of this).

Quantization (KIVI layout, docs/algorithm.md):

- keys per channel: a group is ``g`` consecutive TOKENS of one channel;
- values per token: a group is ``g`` consecutive CHANNELS of one token;
- 2 bit (plain KIVI): z = min, s = (max - min) / 3, q = clamp(round((x - z) / s), 0, 3);
- 1 bit (the paper's modified KIVI): z = (3 min + max) / 4, s = (max - min) / 2,
  q = clamp(round((x - z) / s), 0, 1): reconstructions at min + range/4, min + 3 range/4;
- x' = q * s + z, computed in fp32. Scale and zero are stored in fp16 and rounded *before*
  the codes are chosen, so the codes are optimal for the stored parameters. A constant
  group (s == 0 after rounding) divides by 1 instead and reconstructs to z.

Bit packing, "bit-sliced" (``pack_codes``): N codes (N % 8 == 0) become R = N/8 bytes per
bit plane; byte ``r`` of plane ``k`` holds, in bit ``i``, bit ``k`` of code ``i*R + r``.
Plane 0 (low bits) comes first, then plane 1 (2 bit only). Expanding one bit ``i`` for
all R bytes is a single ``bytes & (1 << i)``, which gives R consecutive codes; so the
torch kernels expand a whole block with one broadcast AND over contiguous memory (no
per-element shifts, no table lookups, which measured 3-10x slower) and undo the 2**i
weights on the small side (score columns for keys, probabilities for values). A native
kernel can do the same per 64-byte row (one byte row, all channels), e.g. a
test-bits-to-mask per token.

Storage layouts (token capacity Lc):

- keys: ``codes`` uint8 ``[B, H, Lc/g, bits, g/8, D]``: per token group, per plane, the
  group's g tokens bit-sliced (byte row r, bit i -> token j*g + i*g/8 + r), channels
  innermost. Expanded, a group's plane is a contiguous ``[g, D]`` matrix: K of the group.
  ``scale``/``zero`` fp16 ``[B, H, Lc/g, D]``. Keys are quantized in whole groups, so the
  number of quantized key tokens ``n`` is always a multiple of g (the engine keeps the
  tail in its exact residual window).
- values: ``codes`` uint8 ``[B, H, Lc/64, bits, 8, D]``: blocks of 64 tokens bit-sliced
  the same way (byte row r, bit i -> token blk*64 + i*8 + r), so expanded blocks are a
  contiguous ``[64 * blocks, D]`` V. ``scale``/``zero`` fp16 ``[B, H, Lc, D/g]``. Any
  ``n`` is allowed; tokens are written one at a time or in runs (read-modify-write of
  the shared bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kvcache.sizes import guide_bits_per_element

__all__ = [
    "QuantizedKeys",
    "QuantizedValues",
    "VALUE_BLOCK",
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
    "guide_bits_per_element",
]

VALUE_BLOCK = 64  # tokens per bit-sliced block of the value codes
_VR = VALUE_BLOCK // 8  # byte rows per value block


def _check_bits(bits: int) -> None:
    if bits not in (1, 2):
        raise ValueError(f"bits must be 1 or 2, got {bits}")


# ----------------------------------------------------------------------------- packing


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack codes (uint8 [..., N], values < 2**bits, N % 8 == 0) into uint8 [..., N*bits/8].

    Bit-sliced, R = N/8: out[..., k*R + r] bit i = bit k of code i*R + r (module docstring).
    """
    _check_bits(bits)
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"the packed axis must be a multiple of 8, got {n}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], 8, n // 8)  # [..., 8 (bit i), R]
    planes = []
    for k in range(bits):
        ck = (c >> k) & 1 if bits > 1 else c
        out = ck[..., 0, :].clone(memory_format=torch.contiguous_format)  # [..., R], a copy
        for i in range(1, 8):
            out |= ck[..., i, :] << i
        planes.append(out)
    return torch.cat(planes, dim=-1)  # [..., bits*R]


def unpack_codes(packed: Tensor, bits: int, n: int | None = None) -> Tensor:
    """Inverse of ``pack_codes``: uint8 [..., M] -> uint8 codes [..., n] (n <= M*8/bits)."""
    _check_bits(bits)
    m = packed.shape[-1]
    total = m * 8 // bits
    n = total if n is None else n
    if not 0 <= n <= total or m % bits:
        raise ValueError(f"cannot unpack {n} codes from {m} bytes at {bits} bit")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)[:, None]  # [8, 1]
    p = packed.reshape(*packed.shape[:-1], bits, 1, m // bits)  # [..., bits, 1, R]
    c = (p >> shifts) & 1  # [..., bits, 8, R]
    if bits == 2:
        c = c[..., 0, :, :] | (c[..., 1, :, :] << 1)
    return c.reshape(*packed.shape[:-1], total)[..., :n]


@functools.lru_cache(maxsize=8)
def _bit_masks(device: torch.device) -> Tensor:
    """Read-only constant: uint8 [8, 1, 1] = 1 << i."""
    return (1 << torch.arange(8, dtype=torch.int32, device=device)).to(torch.uint8).view(8, 1, 1)


@functools.lru_cache(maxsize=32)
def _slice_weights(rows: int, device: torch.device) -> Tensor:
    """Read-only constant: fp32 [8 * rows] = 2**-i for the code at i*rows + r (undoes 1 << i)."""
    w = torch.pow(2.0, -torch.arange(8, dtype=torch.float32, device=device))
    return w.repeat_interleave(rows)


# ------------------------------------------------------------------------ quantization


FP16_MAX = torch.finfo(torch.float16).max


def _params(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Group min/max (fp32) -> (scale, zero) rounded to fp16, within fp16's finite range: a group beyond it
    (|x| > 65504) saturates instead of giving inf (and inf - inf = nan) scores."""
    rng = hi - lo
    if bits == 1:
        s, z = rng / 2, lo + rng / 4  # z = (3 min + max) / 4
    else:  # plain min-max (2 bits; 4 for the outlier channels, engine/kvcache/outliers.py)
        s, z = rng / ((1 << bits) - 1), lo
    return s.clamp(0, FP16_MAX).to(torch.float16), z.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def _codes(x: Tensor, s16: Tensor, z16: Tensor, bits: int) -> Tensor:
    """x with broadcastable fp16 s, z -> uint8 codes; s == 0 (constant group) is guarded."""
    s = s16.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((x - z16.float()) / s)
    return q.clamp_(0, (1 << bits) - 1).to(torch.uint8)


@dataclass
class QuantizedKeys:
    """Per-channel quantized keys (groups of ``group`` tokens); layout in the module docstring."""

    codes: Tensor  # uint8 [B, H, Lc/g, bits, g/8, D]
    scale: Tensor  # fp16 [B, H, Lc/g, D]
    zero: Tensor  # fp16 [B, H, Lc/g, D]
    bits: int
    group: int

    @property
    def capacity(self) -> int:
        """Token slots (a multiple of ``group``)."""
        return self.scale.shape[2] * self.group

    @property
    def head_dim(self) -> int:
        return self.scale.shape[3]

    @property
    def code_tail(self) -> tuple[int, int, int]:
        """The codes' shape after [B, H, groups]: (bits, g/8, D), the layout the kernels read."""
        return self.bits, self.group // 8, self.head_dim

    def prefix(self, n: int) -> "QuantizedKeys":
        """View of the first ``n`` tokens (n % group == 0)."""
        j = _key_groups(n, self.group, self.capacity)
        return QuantizedKeys(
            self.codes[:, :, :j], self.scale[:, :, :j], self.zero[:, :, :j], self.bits, self.group
        )


@dataclass
class QuantizedValues:
    """Per-token quantized values (groups of ``group`` channels); layout in the module docstring."""

    codes: Tensor  # uint8 [B, H, ceil(Lc/64), bits, 8, D]
    scale: Tensor  # fp16 [B, H, Lc, D/g]
    zero: Tensor  # fp16 [B, H, Lc, D/g]
    bits: int
    group: int

    @property
    def capacity(self) -> int:
        """Token slots."""
        return self.scale.shape[2]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1]

    @property
    def code_tail(self) -> tuple[int, int, int]:
        """The codes' shape after [B, H, blocks]: (bits, _VR, D), the layout the kernels read."""
        return self.bits, _VR, self.head_dim

    def prefix(self, n: int) -> "QuantizedValues":
        """View of the first ``n`` tokens."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"n={n} outside [0, {self.capacity}]")
        nb = -(-n // VALUE_BLOCK)
        return QuantizedValues(
            self.codes[:, :, :nb], self.scale[:, :, :n], self.zero[:, :, :n], self.bits, self.group
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
    if group % 8 or group <= 0:
        raise ValueError(f"key group must be a positive multiple of 8, got {group}")
    j = -(-capacity // group)
    return QuantizedKeys(
        codes=torch.zeros(batch, heads, j, bits, group // 8, head_dim, dtype=torch.uint8, device=device),
        scale=torch.zeros(batch, heads, j, head_dim, dtype=torch.float16, device=device),
        zero=torch.zeros(batch, heads, j, head_dim, dtype=torch.float16, device=device),
        bits=bits,
        group=group,
    )


def empty_values(
    batch: int, heads: int, capacity: int, head_dim: int, bits: int, group: int,
    device: torch.device | str | None = None,
) -> QuantizedValues:
    """Zeroed value guide buffer for ``capacity`` tokens (codes rounded up to 64 tokens)."""
    _check_bits(bits)
    if group <= 0 or head_dim % group:
        raise ValueError(f"head_dim {head_dim} must be a multiple of the group {group}")
    nb = -(-capacity // VALUE_BLOCK)
    return QuantizedValues(
        codes=torch.zeros(batch, heads, nb, bits, _VR, head_dim, dtype=torch.uint8, device=device),
        scale=torch.zeros(batch, heads, capacity, head_dim // group, dtype=torch.float16, device=device),
        zero=torch.zeros(batch, heads, capacity, head_dim // group, dtype=torch.float16, device=device),
        bits=bits,
        group=group,
    )


def _quantize_keys_parts(k: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """k [B, H, T, D] (T % g == 0) -> codes [B, H, T/g, bits, g/8, D], scale, zero [B, H, T/g, D]."""
    b, h, t, d = k.shape
    if t % group:
        raise ValueError(f"key token count {t} is not a multiple of the group {group}")
    x = k.float().reshape(b, h, t // group, group, d)  # [B, H, J, g, D]
    s16, z16 = _params(x.amin(3), x.amax(3), bits)  # [B, H, J, D]
    codes = _codes(x, s16[:, :, :, None], z16[:, :, :, None], bits)  # [B, H, J, g, D]
    packed = pack_codes(codes.transpose(-1, -2), bits)  # [B, H, J, D, bits*g/8]
    packed = packed.view(b, h, t // group, d, bits, group // 8).permute(0, 1, 2, 4, 5, 3)
    return packed.contiguous(), s16, z16


def _quantize_values_parts(v: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """v [B, H, T, D] -> codes uint8 [B, H, T, D] (unpacked), scale, zero [B, H, T, D/g]."""
    b, h, t, d = v.shape
    if d % group:
        raise ValueError(f"head_dim {d} is not a multiple of the group {group}")
    x = v.float().reshape(b, h, t, d // group, group)  # [B, H, T, D/g, g]
    s16, z16 = _params(x.amin(-1), x.amax(-1), bits)  # [B, H, T, D/g]
    codes = _codes(x, s16[..., None], z16[..., None], bits).reshape(b, h, t, d)
    return codes, s16, z16


def _pack_value_blocks(codes: Tensor, bits: int) -> Tensor:
    """codes uint8 [B, H, 64*nb, D] -> packed [B, H, nb, bits, 8, D]."""
    b, h, t, d = codes.shape
    c = codes.view(b, h, t // VALUE_BLOCK, VALUE_BLOCK, d).transpose(-1, -2)  # [B, H, nb, D, 64]
    packed = pack_codes(c, bits).view(b, h, t // VALUE_BLOCK, d, bits, _VR)
    return packed.permute(0, 1, 2, 4, 5, 3).contiguous()


def quantize_keys(k: Tensor, bits: int, group: int) -> QuantizedKeys:
    """k [B, H, L, D] with L % group == 0 -> QuantizedKeys holding exactly L tokens."""
    _check_bits(bits)
    if group % 8 or group <= 0:
        raise ValueError(f"key group must be a positive multiple of 8, got {group}")
    codes, s, z = _quantize_keys_parts(k, bits, group)
    return QuantizedKeys(codes, s, z, bits, group)


def quantize_values(v: Tensor, bits: int, group: int) -> QuantizedValues:
    """v [B, H, L, D] with D % group == 0 -> QuantizedValues holding exactly L tokens."""
    _check_bits(bits)
    b, h, t, d = v.shape
    dst = empty_values(b, h, t, d, bits, group, v.device)
    quantize_values_into(dst, v, 0)
    return dst


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
    """Quantize v [B, H, T, D] into ``dst`` tokens [start, start+T) (any start)."""
    t = v.shape[2]
    end = start + t
    if not 0 <= start <= end <= dst.capacity:
        raise ValueError(f"tokens [{start}, {end}) outside capacity {dst.capacity}")
    if t == 0:
        return
    codes, s, z = _quantize_values_parts(v, dst.bits, dst.group)  # codes [B, H, T, D]
    dst.scale[:, :, start:end] = s
    dst.zero[:, :, start:end] = z
    b0, b1 = start // VALUE_BLOCK, -(-end // VALUE_BLOCK)
    if start % VALUE_BLOCK == 0 and (end % VALUE_BLOCK == 0 or end == dst.capacity):
        if t % VALUE_BLOCK:  # the last (partial) block of the buffer: pad with zero codes
            codes = torch.cat([codes, codes.new_zeros(*codes.shape[:2], (b1 - b0) * VALUE_BLOCK - t,
                                                      codes.shape[3])], dim=2)
        dst.codes[:, :, b0:b1] = _pack_value_blocks(codes, dst.bits)
        return
    # Partial blocks: the new tokens share bytes with their neighbours. For each bit i,
    # the tokens with that bit have distinct (block, row) bytes: clear and set bit i.
    for i in range(8):  # positions are plain ints: no device sync
        sel = [t - start for t in range(start, end) if (t % VALUE_BLOCK) // _VR == i]
        if not sel:
            continue
        bi = torch.tensor([(start + t) // VALUE_BLOCK for t in sel], device=v.device)
        ri = torch.tensor([(start + t) % _VR for t in sel], device=v.device)
        ci = codes[:, :, torch.tensor(sel, device=v.device)]  # [B, H, t_i, D]
        for k in range(dst.bits):
            cur = dst.codes[:, :, bi, k, ri]  # [B, H, t_i, D]
            bit = ((ci >> k) & 1) << i
            dst.codes[:, :, bi, k, ri] = (cur & (255 - (1 << i))) | bit


def dequantize_keys(qk: QuantizedKeys, n: int | None = None) -> Tensor:
    """QuantizedKeys -> fp32 [B, H, n, D] (n defaults to the capacity; n % g == 0)."""
    qk = qk.prefix(qk.capacity if n is None else n)
    b, h, j, bits, r, d = qk.codes.shape
    packed = qk.codes.permute(0, 1, 2, 5, 3, 4).reshape(b, h, j, d, bits * r)
    c = unpack_codes(packed, bits).float()  # [B, H, J, D, g]
    x = c * qk.scale.float()[..., None] + qk.zero.float()[..., None]
    return x.transpose(-1, -2).reshape(b, h, j * qk.group, d)


def dequantize_values(qv: QuantizedValues, n: int | None = None) -> Tensor:
    """QuantizedValues -> fp32 [B, H, n, D] (n defaults to the capacity)."""
    n = qv.capacity if n is None else n
    qv = qv.prefix(n)
    b, h, nb, bits, r, d = qv.codes.shape
    packed = qv.codes.permute(0, 1, 2, 5, 3, 4).reshape(b, h, nb, d, bits * r)
    c = unpack_codes(packed, bits).transpose(-1, -2).reshape(b, h, nb * VALUE_BLOCK, d)[:, :, :n]
    g = qv.group
    c = c.float().reshape(b, h, n, d // g, g)
    x = c * qv.scale.float()[..., None] + qv.zero.float()[..., None]
    return x.reshape(b, h, n, d)
