"""Decode-step linears on the CPU (`SkinnyLinear`): native kernels for a few rows, and exactly packed weights.

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

The weights' types are engine.model.held_weights' (PackedWeight, DenseWeight, pack_weight, native_linear)
and engine.model.kquant_weights' (Q6KWeight, KQuantWeight), their formats engine.model.block_formats';
the pass flags (prefill_pass, row_invariant) engine.model.linear_passes'; the embedding over a held weight
and the held-bytes counts engine.model.held_model's.
"""
from __future__ import annotations

import os

import torch

from engine.native import calibrate
from engine.native.calibrate import skinny_torch_linear
from engine.backends.native_cpu import DecodeCall
from engine.model.decode_kernels import decode_call
from engine.model.held_weights import HeldWeight, PackedWeight, native_linear, pack_weight
from engine.model.linear_passes import IN_PREFILL, ROW_INVARIANT

ENV_PACK = "SPECACHE_PACK_WEIGHTS"  # 0/false/no/off: never pack (A/B runs)


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
    TILE_ELEMENTS = 1 << 22  # weights rebuilt at a time for many rows (16 MiB in fp32, 8 MiB in a bf16 prefill)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # no rows (a prefill chunk's lm_head before the last chunk): nothing to read
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.decoder is not None and not IN_PREFILL.get():  # a decode step's held linear: the lean path
            y = self.decoder(x)
            if y is not None:
                return y
        rows = x.numel() // x.shape[-1]
        if self.weight is None:  # held in its blocks only: the native kernel on them, or tiles rebuilt
            return self.held_forward(x.reshape(rows, -1)).reshape(*x.shape[:-1], -1)
        # the native kernel only where it measured faster than torch for this weight form and row count
        by = 1 if ROW_INVARIANT.get() else rows  # exact mode: the one-row step's kernel for every row count
        fast = x.is_cpu and rows <= self.NATIVE_ROWS and calibrate.use_native(self.packed.fmt if self.packed else 0, by)
        if rows > self.SKINNY_ROWS or not x.is_cpu:
            if self.prefill_dtype is not None and x.is_cpu and x.dtype != self.prefill_dtype and IN_PREFILL.get():
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
        time rebuilt in fp32 and multiplied (in prefill_dtype within a prefill pass, but for a few rows:
        the last chunk's lm_head row would rebuild the whole 262144 x 640 weight of Gemma 3 for one row)."""
        prefill = IN_PREFILL.get()
        fast = self.prefill_dtype is not None and prefill
        if flat.shape[0] <= (self.SKINNY_ROWS if fast else self.NATIVE_ROWS):
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
        """flat [R, K] @ W^T (+ bias), W rebuilt in `dtype` (the prefill dtype; None: fp32) TILE_ELEMENTS weights at
        a time (never whole, but a layer's weight of up to that size is one tile and one GEMM); a weight held
        in the prefill dtype itself (a bf16 folder's) multiplies as it is, as prefill_forward does."""
        w16 = getattr(self.held, "w", None)
        if dtype is not None and w16 is not None and w16.dtype == dtype:
            y = torch.nn.functional.linear(flat.to(dtype), w16).to(flat.dtype)
            return y + self.bias if self.bias is not None else y
        n, k = self.held.shape
        step = max(16, self.TILE_ELEMENTS // k // 16 * 16)
        x = flat.to(dtype or flat.dtype)
        if step >= n:
            y = torch.nn.functional.linear(x, self.held.rows(0, n, x.dtype)).to(flat.dtype)
        else:
            y = torch.empty(flat.shape[0], n, dtype=flat.dtype)
            for n0 in range(0, n, step):
                n1 = min(n, n0 + step)
                y[:, n0:n1] = x @ self.held.rows(n0, n1, x.dtype).T
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
