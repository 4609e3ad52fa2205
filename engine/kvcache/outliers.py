"""Outlier key channels of the guide (bench-results/guide-study-findings.md): in each
(layer, KV head) a few channels carry keys far larger than the rest, and a 1-bit code of the whole
head spends its range on them. With ``outliers`` = O > 0 the guide keeps those O channels in a side
guide of 4-bit codes (min-max per channel over groups of g tokens, fp16 scale and zero, like the
main key guide at 4 bits) and quantizes the head's keys with those channels set to zero (without a
rotation a constant group reconstructs exactly to 0), so

    q . k_hat = q . k1_hat (main guide, kernels unchanged) + q_O . k4_hat_O (this side guide).

The channels are chosen once per row, from the first keys the row quantizes (the largest |k| of
each channel over those tokens, per KV head), and kept with the row (exported with the guide).
With a rotation R (engine.kvcache.rotation) the channels are taken out first, in the model's own
coordinates, and the rest of the keys is rotated and quantized (scored with q R), the side guide with q.
Only the guide is changed: the exact store, sinks, window and fetched set keep every channel.

Layout (token capacity Lc, a multiple of g): ``idx`` int64 [B, H, O] (the channels, ascending);
``codes`` uint8 [B, H, Lc, ceil(O/2)] (two 4-bit codes per byte, channel 2i in the low nibble);
``scale``/``zero`` fp16 [B, H, Lc/g, O].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kvcache.codes import _codes as quant_codes
from engine.kvcache.codes import _params as quant_params
from engine.kvcache.sizes import OUTLIER_BITS


def choose_channels(k: Tensor, count: int) -> Tensor:
    """k [H, n, D] -> the `count` channels of largest |k| per head, ascending: int64 [H, count]."""
    return k.abs().amax(1).topk(count, dim=-1).indices.sort(dim=-1).values


def quantize(x: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [H, n, O] (n % g == 0) -> codes uint8 [H, n, O] (unpacked), scale, zero fp16 [H, n/g, O].
    Min-max at 4 bits; scale and zero rounded to fp16 before the codes are chosen (as quant.py)."""
    h, n, o = x.shape
    xg = x.float().reshape(h, n // group, group, o)
    s16, z16 = quant_params(xg.amin(2), xg.amax(2), OUTLIER_BITS)  # [H, J, O]
    codes = quant_codes(xg, s16[:, :, None], z16[:, :, None], OUTLIER_BITS)
    return codes.reshape(h, n, o), s16, z16


def pack(codes: Tensor) -> Tensor:
    """uint8 [..., O] codes < 16 -> [..., ceil(O/2)]: channel 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: Tensor, count: int) -> Tensor:
    """Inverse of ``pack``: [..., ceil(O/2)] -> uint8 [..., O]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)[..., :count]


@dataclass
class OutlierKeys:
    """The side guide of one layer (module docstring)."""

    idx: Tensor  # int64 [B, H, O]
    codes: Tensor  # uint8 [B, H, Lc, ceil(O/2)]
    scale: Tensor  # fp16 [B, H, Lc/g, O]
    zero: Tensor  # fp16 [B, H, Lc/g, O]
    group: int

    @classmethod
    def empty(cls, batch: int, heads: int, capacity: int, count: int, group: int,
              device: torch.device | str | None = None) -> "OutlierKeys":
        j = -(-capacity // group)
        z16 = lambda: torch.zeros(batch, heads, j, count, dtype=torch.float16, device=device)  # noqa: E731
        return cls(torch.zeros(batch, heads, count, dtype=torch.long, device=device),
                   torch.zeros(batch, heads, j * group, -(-count // 2), dtype=torch.uint8, device=device),
                   z16(), z16(), group)

    @property
    def count(self) -> int:
        return self.idx.shape[-1]

    def split(self, row: int, start: int, k: Tensor) -> Tensor:
        """Quantize the outlier channels of row `row`'s keys k [1, H, n, D] at [start, start + n)
        (n % g == 0; start 0 chooses the row's channels) -> k with those channels zeroed (a copy)."""
        if start == 0:
            self.idx[row] = choose_channels(k[0], self.count)
        idx = self.idx[row][None, :, None, :].expand(1, -1, k.shape[2], -1)  # [1, H, n, O]
        codes, s, z = quantize(k.float().gather(-1, idx)[0], self.group)
        n, g = k.shape[2], self.group
        self.codes[row, :, start : start + n] = pack(codes)
        self.scale[row, :, start // g : (start + n) // g] = s
        self.zero[row, :, start // g : (start + n) // g] = z
        return k.scatter(-1, idx, 0.0)

    def dequantize(self, rows: slice, n: int) -> Tensor:
        """The first n tokens' outlier keys of rows -> fp32 [b, H, n, O]."""
        c = unpack(self.codes[rows, :, :n], self.count).float()  # [b, H, n, O]
        b, h = c.shape[:2]
        c = c.reshape(b, h, n // self.group, self.group, self.count)
        x = c * self.scale[rows, :, : n // self.group, None].float() + self.zero[rows, :, : n // self.group, None].float()
        return x.reshape(b, h, n, self.count)

    def scores(self, q: Tensor, rows: slice, n: int) -> Tensor:
        """q [b, H, Q, D] (unrotated) -> q_O . k4_hat_O over the first n tokens: [b, H, Q, n]."""
        idx = self.idx[rows][:, :, None, :].expand(-1, -1, q.shape[2], -1)  # [b, H, Q, O]
        return q.float().gather(-1, idx) @ self.dequantize(rows, n).transpose(-1, -2)

    def export_row(self, row: int, n: int) -> dict[str, Tensor]:
        """Row `row`'s side guide of its first n tokens (views)."""
        return {"o_idx": self.idx[row], "o_codes": self.codes[row, :, :n],
                "o_scale": self.scale[row, :, : n // self.group], "o_zero": self.zero[row, :, : n // self.group]}

    def copy_row(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def tensors(self) -> list[Tensor]:
        return [self.idx, self.codes, self.scale, self.zero]
