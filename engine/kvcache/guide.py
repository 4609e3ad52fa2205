"""The guide of one layer: every quantized position's K and V in 1 or 2 bits (engine.kvcache.quant),
preallocated for the planned length, filled a group of g tokens at a time, optionally of K R and V R
for an orthogonal R (engine.kvcache.rotation: queries rotated in, the value output rotated back),
optionally with a few outlier key channels at 4 bits beside it (engine.kvcache.outliers: taken out of
the keys before they are rotated and quantized, scored with the unrotated queries)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.kvcache import quant
from engine.kvcache.base import import_tensors
from engine.kvcache.outliers import OutlierKeys
from engine.kvcache.rotation import rotation_helps, rotation_matrix
from engine.kvcache.sizes import guide_bytes, guide_capacity, value_group


@dataclass(frozen=True)
class GuideSpec:
    """A guide's settings: bits (1 or 2), the key group g (tokens), the rotation ("none", "hadamard" or
    "auto") and the outlier key channels kept at 4 bits."""

    bits: int
    group: int
    rotation: str = "none"
    outliers: int = 0


class Guide:
    """Quantized K [B, H_kv, L, D] (per-channel groups of g tokens) and V (per-token groups)."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, spec: GuideSpec,
                 device: torch.device):
        bits, group, rotation, outliers = spec.bits, spec.group, spec.rotation, spec.outliers
        cap = guide_capacity(max_len, group)
        if not 0 <= outliers < head_dim:
            raise ValueError(f"outliers must be in 0..{head_dim - 1} for head_dim {head_dim}, not {outliers}")
        self.rotation = rotation_matrix(rotation, head_dim, device)  # R fp32 [D, D], or None
        self.auto = self.auto_made = rotation == "auto"  # R or none, chosen at the first add (rotation_helps)
        self.outliers = OutlierKeys.empty(batch, kv_heads, cap, outliers, group, device) if outliers else None
        self.keys = quant.empty_keys(batch, kv_heads, cap, head_dim, bits, group, device)
        self.values = quant.empty_values(batch, kv_heads, cap, head_dim, bits, value_group(group, head_dim), device)
        self.bits, self.group = bits, group
        self.shape = _LayerShape(kv_heads, head_dim)

    def add(self, row: int, start: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None) -> None:
        """Quantize exact k/v [1, H_kv, n, D] of positions [start, start + n) of one row (n % g == 0); q: the
        layer's latest queries [1, H_kv, m, D], for an auto rotation's choice."""
        keys = replace(self.keys, codes=self.keys.codes[row : row + 1], scale=self.keys.scale[row : row + 1],
                       zero=self.keys.zero[row : row + 1])
        values = replace(self.values, codes=self.values.codes[row : row + 1],
                         scale=self.values.scale[row : row + 1], zero=self.values.zero[row : row + 1])
        k, v = k.to(keys.codes.device), v.to(values.codes.device)
        if self.outliers is not None:  # their channels to the side guide, zero in the main one (before R)
            k = self.outliers.split(row, start, k)
        if self.auto:  # the layer's first keys decide, for every row (export_row carries the choice)
            self.decide(rotation_helps(k.float(), v.float(), self.rotation, self.bits, self.group,
                                       None if q is None else q.to(k.device)))
        if self.rotation is not None:  # [1, H_kv, n, D] @ R
            k, v = k.float() @ self.rotation, v.float() @ self.rotation
        quant.quantize_keys_into(keys, k, start)
        quant.quantize_values_into(values, v, start)

    def decide(self, rotate: bool) -> None:
        """Fix an ``auto`` guide's rotation: R, or none."""
        if not rotate:
            self.rotation = None
        self.auto = False

    @property
    def rotated(self) -> bool:
        return self.rotation is not None

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst's guide becomes a copy of row src's."""
        for q in (self.keys, self.values):
            for t in (q.codes, q.scale, q.zero):
                t[dst] = t[src]
        if self.outliers is not None:
            self.outliers.copy_row(src, dst)

    def export_row(self, row: int, n: int) -> dict[str, torch.Tensor]:
        """Row `row`'s guide of its first n quantized tokens (n % g == 0), as views."""
        kg, vb = n // self.group, -(-n // quant.VALUE_BLOCK)
        k, v = self.keys, self.values
        out = {"k_codes": k.codes[row, :, :kg], "k_scale": k.scale[row, :, :kg], "k_zero": k.zero[row, :, :kg],
               "v_codes": v.codes[row, :, :vb], "v_scale": v.scale[row, :, :n], "v_zero": v.zero[row, :, :n]}
        if self.outliers is not None:
            out.update(self.outliers.export_row(row, n))
        if self.choice is not None:  # an auto guide's choice (the codes mean nothing without it)
            out["rotated"] = self.choice
        return out

    @property
    def choice(self) -> torch.Tensor | None:
        """An auto guide's decided rotation as a tensor (1: rotated), None for a set one or one not decided."""
        return None if self.auto or not self.auto_made else torch.tensor([int(self.rotated)])

    def import_row(self, row: int, n: int, tensors: dict[str, torch.Tensor], check: bool = False) -> None:
        """Make row `row`'s guide hold an export_row() of n tokens (check: only validate); an auto guide
        not decided yet takes the stored row's choice, a decided one must have made the same."""
        got = tensors.get("rotated")
        if got is not None and self.auto_made:
            if not self.auto and int(got) != int(self.rotated):
                raise ValueError("the stored guide's rotation differs from this cache's")
            if self.auto and not check:
                self.decide(bool(int(got)))
            own = {k: t for k, t in self.export_row(row, n).items() if k != "rotated"}
            import_tensors(own, {k: t for k, t in tensors.items() if k != "rotated"}, check, strict=True)
            return
        import_tensors(self.export_row(row, n), tensors, check, strict=True)

    def scores(self, q: torch.Tensor, rows: slice, n: int) -> torch.Tensor:
        """q [b, H_kv, Q, D] against the first n quantized keys of rows -> [b, H_kv, Q, n] (unscaled)."""
        scores = quant.guide_scores(q.float() @ self.rotation if self.rotation is not None else q,
                                    _rows(self.keys, rows), n)  # (q R) . (k R) = q . k
        if self.outliers is not None and n:  # + q_O . k4_O, in the model's own coordinates
            scores = scores + self.outliers.scores(q, rows, n)
        return scores

    def weighted_values(self, p: torch.Tensor, rows: slice, n: int) -> torch.Tensor:
        """p [b, H_kv, Q, n] times the first n quantized values of rows -> [b, H_kv, Q, D]."""
        out = quant.guide_weighted_values(p, _rows(self.values, rows), n)
        return out if self.rotation is None else out @ self.rotation.T  # (p @ V R) R^T

    def bytes(self, tokens: int, rows: int = 1) -> int:
        """Storage of `tokens` quantized tokens of `rows` rows (K and V, codes + fp16 scale and zero; the
        outlier side guide) of this layer."""
        return guide_bytes(self.shape, tokens, self.bits, self.group, layers=1, outliers=self.outlier_count,
                           rows=rows)

    @property
    def outlier_count(self) -> int:
        return 0 if self.outliers is None else self.outliers.count

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the guide (for the allocated-bytes account)."""
        return [self.keys.codes, self.keys.scale, self.keys.zero, self.values.codes, self.values.scale,
                self.values.zero] + (self.outliers.tensors() if self.outliers is not None else [])


@dataclass(frozen=True)
class _LayerShape:
    """One layer's KV shape, as engine.kvcache.sizes reads it."""

    kv_heads: int
    head_dim: int
    layers: int = 1


def _rows(q, rows: slice):
    """The same quantized tensor restricted to a slice of batch rows (a view)."""
    return replace(q, codes=q.codes[rows], scale=q.scale[rows], zero=q.zero[rows])
