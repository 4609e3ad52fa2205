"""Write the reference files of the native kernel check (tests/native/kernel_check.c, tests/test_arm64.py).

    PYTHONPATH=$PWD .venv/bin/python scripts/make_kernel_refs.py [--out tests/data/kernels]

Each file holds small inputs of the native kernels (engine/native/*.c) and what the TORCH
reference implementations give for them: the native library is disabled here
($SPECACHE_NATIVE=0), so every result below comes from the code the native kernels replace:

  linear.bin  fp32 skinny linear (rows 1, 3, 8; K 96 and 100; with and without bias) against
              F.linear; exact affine4 / scaled8 block weights (as tests/test_linears.py makes
              them), the bytes the packers must write (a numpy re-implementation of the
              packing rule in linear_kernels.c's comment) and F.linear of them; GGUF Q6_K blocks
              (random bytes, fp16 d of either sign, one subnormal, one zero), the weight torch
              rebuilds from them (Q6KWeight.torch_rows, gguf.quants' floats) and F.linear of it; the same
              for GGUF Q4_K and Q5_K blocks (KQuantWeight.torch_rows) and Q4_0, Q4_1, Q8_0, Q5_0, Q5_1
              blocks (PackedWeight.torch_rows);
  guide.bin   guide scores and weighted values (engine/kvcache/quant.py, torch path) for 1 and
              2 bits, key groups 32 and 64, value groups 16, 32 and 64, head_dim 64, with 1, 2,
              3 and 9 queries (the few-query kernels, one 8-lane block and a partial one);
  fused.bin   the fused decode attention of one GuidedLayer of a tiny model (the GQA shape of
              tests/conftest.py: 6 query heads on 2 KV heads, head_dim 32): every buffer its
              DecodeArgs points to, its scalar fields, and the torch decode path's output
              (GuidedLayer.attend_decode) and selection weights, for prefetch speculative
              (2 and 1 bit, select_both, corrected -- the default -- and not, a hadamard-rotated guide)
              and current (on cache row 1 of 2; rotated), both also softcapped (Gemma 2); and a sliding-window
              layer's decode attention over its ring (SlidingWindowLayer.attend_torch: two new tokens, rows of
              different lengths, one ring wrapped, softcapped or not).

The layer's state is written through its own API (update, commit: sinks, residual window,
host store, quantization) from seeded random K/V, and the fetched set from seeded random
positions, instead of running a model: so every input is made by torch's seeded RNG and
exact elementwise ops only, the same bytes wherever that RNG gives the same numbers
(tests/test_arm64.py regenerates the files and compares); only the reference outputs
(matmuls, softmax) may differ across CPUs by float rounding.

File format (little-endian): b"SPKREF1\\n", uint32 count, then per blob: uint32 name length,
the name, one dtype byte (struct codes: f float32, e float16, B uint8, b int8, i int32,
q int64, s a string), uint8 ndim, int64 shape[ndim], uint64 byte count, the bytes (C order).
Blob names are "<kind>:<case>/<field>"; a case's "base" field names another case whose
fields it shares (written once; a field is looked up in the case, then in its base).
Fields whose name starts with "ref_" are reference outputs, the rest inputs.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from engine import native
from engine.config import CacheConfig
from engine.kvcache import make_cache
from engine.kvcache.base import ModelShape, Step, grouped_query
from engine.backends.native_fused import FusedDecode
from engine.kvcache.sliding import SlidingWindowLayer
from engine.kvcache.transfer import Transfer
from engine.kvcache.quant import guide_scores, guide_weighted_values, quantize_keys, quantize_values
from engine.model.block_formats import (BF16_FMT, F16_FMT, FORMATS, MIN_FMTS, Q40_FMT, Q41_FMT, Q4K_FMT, Q50_FMT,
                                        Q51_FMT, Q5K_FMT, Q6K_FMT, Q80_FMT, SUPERBLOCK_BYTES)
from engine.model.gguf_tensors import split_block_rows
from engine.model.held_weights import PackedWeight
from engine.model.kquant_weights import KQuantWeight, Q6KWeight

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "kernels"
MAGIC = b"SPKREF1\n"
TAGS = {np.dtype(np.float32): b"f", np.dtype(np.float16): b"e", np.dtype(np.uint8): b"B", np.dtype(np.int8): b"b",
        np.dtype(np.int32): b"i", np.dtype(np.int64): b"q", np.dtype(np.bool_): b"B"}
QUERIES = (1, 2, 3, 9)  # query counts of the guide cases: the few-query paths; one 8-lane block and a partial one


# --------------------------------------------------------------------------- container


def _encode(value) -> tuple[bytes, tuple[int, ...], bytes]:
    """(dtype tag, shape, raw bytes) of a tensor, array, int, float or str."""
    if isinstance(value, str):
        raw = value.encode()
        return b"s", (len(raw),), raw
    if isinstance(value, int):  # (bools too)
        value = np.array(value, dtype=np.int64)
    elif isinstance(value, float):
        value = np.array(value, dtype=np.float32)
    elif isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    a = np.array(value, order="C")  # (keeps 0-d scalars 0-d)
    if a.dtype not in TAGS:
        raise TypeError(f"no tag for {a.dtype}")
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    return TAGS[a.dtype], a.shape, a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


@dataclasses.dataclass
class Case:
    """One case of a file: case[field] = value encodes the value (see _encode)."""

    name: str  # "<kind>:<label>"
    base: "Case | None" = None
    fields: dict = dataclasses.field(default_factory=dict)

    def __setitem__(self, key, value) -> None:
        self.fields[key] = _encode(value)


def write(path: Path, cases: list[Case]) -> None:
    """Write cases; a field equal to its base case's (same dtype, shape and bytes) is left to the base."""
    blobs = []
    for case in cases:
        fields = dict(case.fields)
        if case.base is not None:
            fields = {k: v for k, v in fields.items() if case.base.fields.get(k) != v}
            fields["base"] = _encode(case.base.name)
        blobs += [(f"{case.name}/{k}", v) for k, v in fields.items()]
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(blobs)))
        for name, (tag, shape, raw) in blobs:
            nb = name.encode()
            f.write(struct.pack("<I", len(nb)) + nb + tag + struct.pack("<B", len(shape)))
            f.write(struct.pack(f"<{len(shape)}q", *shape) + struct.pack("<Q", len(raw)) + raw)


def read(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes, int]]:
    """name -> (dtype tag, shape, bytes, offset of the bytes in the file), in file order."""
    data = Path(path).read_bytes()
    if data[:8] != MAGIC:
        raise ValueError(f"{path}: not a kernel reference file")
    (count,), pos, out = struct.unpack_from("<I", data, 8), 12, {}
    for _ in range(count):
        (n,) = struct.unpack_from("<I", data, pos)
        name = data[pos + 4 : pos + 4 + n].decode()
        pos += 4 + n
        tag, ndim = chr(data[pos]), data[pos + 1]
        shape = struct.unpack_from(f"<{ndim}q", data, pos + 2)
        pos += 2 + 8 * ndim
        (nbytes,) = struct.unpack_from("<Q", data, pos)
        out[name] = (tag, tuple(shape), data[pos + 8 : pos + 8 + nbytes], pos + 8)
        pos += 8 + nbytes
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} trailing bytes")
    return out


# ----------------------------------------------------------------------------- linears


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def affine4_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Exactly m + d * q per block of 32 (d, m fp16 values, q in 0..15), like Q4_1 (tests/test_linears.py)."""
    g = gen(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the block's min and max codes, as a quantizer makes them
    return torch.addcmul(m, d, q).reshape(n, k)


def scaled8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Exactly d * q per block of 32 (d fp16, q int8 with |q| max 127), like Q8_0 (tests/test_linears.py)."""
    g = gen(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


def _fp16_mantissa(x: np.ndarray) -> np.ndarray:
    """linear_kernels.c fp16_mantissa: round to a 10-bit mantissa on the float's bits."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def pack_affine4(w: np.ndarray) -> np.ndarray:
    """The packing rule of linear_kernels.c (specache_pack_affine4), in numpy float32: per block of
    32, lo = min, d = fp16_mantissa((max - lo) / 15), q = clamp(rint((w - lo) / d), 0, 15), record
    {float d, float lo, byte j = q[j] | q[j + 16] << 4}. Raises unless fma(d, q, lo) == w everywhere
    (d * q is exact in float32 here: d has 11 significant bits, q 4, so d * q + lo is the fma)."""
    n, k = w.shape
    b = w.astype(np.float32).reshape(n, k // 32, 32)
    lo, hi = b.min(-1), b.max(-1)
    d = _fp16_mantissa((hi - lo) / np.float32(15.0))
    dd = np.where(d > 0, d, np.float32(1.0))[..., None]
    q = np.where(d[..., None] > 0, np.rint((b - lo[..., None]) / dd), np.float32(0.0)).clip(0, 15).astype(np.float32)
    prod = d[..., None] * q
    assert np.array_equal(prod.astype(np.float64), d[..., None].astype(np.float64) * q.astype(np.float64))
    if not np.array_equal(prod + lo[..., None], b):
        raise ValueError("not an exact affine4 weight")
    qi = q.astype(np.uint8)
    codes = qi[..., :16] | (qi[..., 16:] << 4)
    rec = np.concatenate([d[..., None].view(np.uint8), lo[..., None].view(np.uint8), codes], axis=-1)
    return rec.reshape(n, k // 32 * 24)


def pack_scaled8(w: np.ndarray) -> np.ndarray:
    """specache_pack_scaled8's rule: d = max |w| / 127, q = clamp(rint(w / d), -128, 127), record
    {float d, int8 q[32]}; raises unless d * q == w everywhere."""
    n, k = w.shape
    b = w.astype(np.float32).reshape(n, k // 32, 32)
    d = np.abs(b).max(-1) / np.float32(127.0)
    dd = np.where(d > 0, d, np.float32(1.0))[..., None]
    q = np.where(d[..., None] > 0, np.rint(b / dd), np.float32(0.0)).clip(-128, 127).astype(np.float32)
    if not np.array_equal(d[..., None] * q, b):
        raise ValueError("not an exact scaled8 weight")
    rec = np.concatenate([d[..., None].view(np.uint8), q.astype(np.int8).view(np.uint8)], axis=-1)
    return rec.reshape(n, k // 32 * 36)


def q6k_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """GGUF Q6_K bytes [n, k / 256 * 210] (linear_kernels.c's layout): random codes and int8 scales, a
    random fp16 d of either sign per superblock, the first one subnormal and the second zero."""
    g = gen(seed)
    raw = torch.randint(0, 256, (n * k // 256, 210), generator=g, dtype=torch.uint8)
    d = (torch.randn(len(raw), generator=g) * 1e-3).half()
    d.view(torch.int16)[:2] = torch.tensor([0x8005 - 0x10000, 0], dtype=torch.int16)  # 0x8005: -5 * 2^-24 (subnormal); +0
    raw[:, 208:210] = d.view(torch.uint8).view(-1, 2)
    return raw.reshape(n, -1)


def _linear_refs(case: Case, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> None:
    for rows in (1, 3, 8):
        case[f"ref_y_r{rows}"] = torch.nn.functional.linear(x[:rows], w)
        case[f"ref_y_r{rows}_bias"] = torch.nn.functional.linear(x[:rows], w, bias)


def _random_block_case(name: str, fmt: int, held, n: int, k: int, per: int, size: int, scales: tuple[int, ...],
                       zeroed: int) -> Case:
    """packed:<name>: random GGUF blocks [n, k] of `size` bytes per `per` weights (every code bit random), the
    fp16 fields at byte offsets `scales` random of either sign, the first block's d subnormal and the second
    block's field at `zeroed` zero; the weight torch rebuilds (held(fmt, ...).torch_rows) and F.linear of it."""
    g = gen(1000 + fmt)
    raw = torch.randint(0, 256, (n * k // per, size), generator=g, dtype=torch.uint8)
    for off in scales:
        raw[:, off:off + 2] = (torch.randn(len(raw), generator=g) * 1e-3).half().view(torch.uint8).view(-1, 2)
    raw[0, 0:2] = torch.tensor([0x05, 0x80], dtype=torch.uint8)  # d = -5 * 2^-24
    raw[1, zeroed:zeroed + 2] = 0
    raw = raw.reshape(n, -1)
    if held is PackedWeight:  # Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1: each row's codes, then its scales (linear_kernels.c)
        raw = torch.from_numpy(split_block_rows(raw.numpy(), fmt, n))
    w = held(fmt, raw, (n, k)).torch_rows(0, n)
    c = Case(f"packed:{name}")
    x, bias = torch.randn(8, k, generator=g), torch.randn(n, generator=g)
    c["fmt"], c["w"], c["packed"], c["x"], c["bias"] = fmt, w, raw, x, bias
    _linear_refs(c, x, w, bias)
    return c


def linear_cases() -> list[Case]:
    cases = []
    for k, n in ((96, 40), (100, 40)):  # K a multiple of 32 (whole blocks) and not (the scalar tail)
        g = gen(k)
        c = Case(f"skinny:k{k}")
        x, w, bias = torch.randn(8, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        c["x"], c["w"], c["bias"] = x, w, bias
        _linear_refs(c, x, w, bias)
        cases.append(c)
    # affine4 N 256: the kernels split the columns over the threads from N 256 on (run_linear), so its
    # 2-thread runs (packed and the fp32 kernel on the same weight) take that path; the others do not
    for fmt, make, pack, n, k in ((4, affine4_weight, pack_affine4, 256, 64),
                                  (8, scaled8_weight, pack_scaled8, 64, 96)):
        g = gen(1000 + fmt)
        w = make(n, k, seed=fmt)
        c = Case(f"packed:{'affine4' if fmt == 4 else 'scaled8'}")
        x, bias = torch.randn(8, k, generator=g), torch.randn(n, generator=g)
        c["fmt"], c["w"], c["packed"], c["x"], c["bias"] = fmt, w, pack(w.numpy()), x, bias
        _linear_refs(c, x, w, bias)
        cases.append(c)
    # Q6_K (fmt 6): K 512 (two superblocks a row), the blocks as the GGUF has them and the weight torch rebuilds
    n, k = 16, 512
    g = gen(1006)
    raw = q6k_blocks(n, k, seed=6)
    w = Q6KWeight(Q6K_FMT, raw, (n, k)).torch_rows(0, n)
    c = Case("packed:q6k")
    x, bias = torch.randn(8, k, generator=g), torch.randn(n, generator=g)
    c["fmt"], c["w"], c["packed"], c["x"], c["bias"] = 6, w, raw, x, bias
    _linear_refs(c, x, w, bias)
    cases.append(c)
    # Q4_K (fmt 7) and Q5_K (fmt 5): K 512, random blocks (every scale / min / code bit random), fp16 d and
    # dmin of either sign, the first superblock's d subnormal and the second's dmin zero
    for fmt, name in ((Q4K_FMT, "q4k"), (Q5K_FMT, "q5k")):
        cases.append(_random_block_case(name, fmt, KQuantWeight, 8, k, 256, SUPERBLOCK_BYTES[fmt], (0, 2), 2))
    # Q4_0 (fmt 2), Q4_1 (fmt 3), Q8_0 (fmt 9), Q5_0 (fmt 10), Q5_1 (fmt 11): K 64 (2 blocks a row), random codes,
    # fp16 d (and m) of either sign, the first block's d subnormal and the second's zero (small: the files stay
    # near 1 MB)
    for fmt, name in ((Q40_FMT, "q4_0"), (Q41_FMT, "q4_1"), (Q80_FMT, "q8_0"), (Q50_FMT, "q5_0"), (Q51_FMT, "q5_1")):
        cases.append(_random_block_case(name, fmt, PackedWeight, 32, 64, 32, FORMATS[fmt],
                                        (0, 2) if fmt in MIN_FMTS else (0,), 0))
    # bf16 (fmt 12) and fp16 (fmt 13) weights as they are: K 64, random 16-bit patterns (every bit random:
    # subnormals and infinities too; NaNs replaced, they would not compare), 8 rows
    for fmt, name, dtype in ((BF16_FMT, "bf16", torch.bfloat16), (F16_FMT, "f16", torch.float16)):
        g = gen(1000 + fmt)
        raw = torch.randint(-32768, 32768, (8, 64), generator=g, dtype=torch.int32).to(torch.int16).view(dtype)
        raw = torch.where(torch.isfinite(raw.float()), raw, torch.zeros((), dtype=dtype)).view(torch.int16)
        raw = torch.where(raw.view(dtype).float().abs() < 4.0, raw, (raw & 0x00FF).to(torch.int16))  # mostly moderate
        c = Case(f"packed:{name}")
        w = raw.view(dtype).to(torch.float32)
        x, bias = torch.randn(8, 64, generator=g), torch.randn(8, generator=g)
        c["fmt"], c["w"], c["packed"], c["x"], c["bias"] = fmt, w, raw.view(torch.uint8).reshape(8, -1), x, bias
        _linear_refs(c, x, w, bias)
        cases.append(c)
    return cases


# ------------------------------------------------------------------------------- guide


def kv_like(*shape: int, seed: int) -> torch.Tensor:
    """Random data with per-channel offsets and a few outliers, like real keys (tests/test_quant.py)."""
    g = gen(seed)
    x = torch.randn(*shape, generator=g)
    x += 3 * torch.randn(shape[-1], generator=g)  # channel offsets
    x.view(-1)[::97] *= 8  # outliers
    return x


def guide_cases() -> list[Case]:
    h, d, qmax = 2, 64, max(QUERIES)
    cases, first = [], {}
    for bits, group, batch in ((2, 32, 2), (2, 64, 1), (1, 32, 1), (1, 64, 1)):
        n = 2 * group  # of a capacity of 3 groups: the kernel reads only the first n tokens
        qk = quantize_keys(kv_like(batch, h, 3 * group, d, seed=10 * bits + group), bits, group)
        q = torch.randn(batch, h, qmax, d, generator=gen(batch))
        c = Case(f"scores:b{bits}_g{group}", base=first.get(batch))
        first.setdefault(batch, c)
        c["n"], c["g"], c["bits"] = n, group, bits
        c["q"], c["codes"], c["scale"], c["zero"] = q, qk.codes, qk.scale, qk.zero
        for nq in QUERIES:  # the first nq queries: a strided view, as the engine's are
            c[f"ref_out_q{nq}"] = guide_scores(q[:, :, :nq], qk, n)
        cases.append(c)
    first = {}
    for bits, group, batch in ((2, 32, 1), (2, 64, 1), (1, 32, 1), (2, 16, 1), (1, 64, 2)):
        n, cap = 100, 128  # the second 64-token block partial; tokens past n hold data the kernel must not read
        qv = quantize_values(kv_like(batch, h, cap, d, seed=100 + 10 * bits + group), bits, group)
        u = torch.rand(batch, h, qmax, n, generator=gen(200 + batch))
        p = (u * u) * (u * u) * (5.0 / n)  # peaky weights summing to about 1 (exact ops, unlike a softmax)
        c = Case(f"values:b{bits}_g{group}", base=first.get(batch))
        first.setdefault(batch, c)
        c["n"], c["gv"], c["bits"] = n, group, bits
        c["p"], c["codes"], c["scale"], c["zero"] = p, qv.codes, qv.scale, qv.zero
        for nq in QUERIES:
            c[f"ref_out_q{nq}"] = guide_weighted_values(p[:, :, :nq], qv, n)
        cases.append(c)
    return cases


# ------------------------------------------------------------------------------- fused

# tests/conftest.py tiny_config's attention shape (GQA group 3), one layer
TINY = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, head_dim=32, hidden_size=192, num_hidden_layers=1)
LENGTHS = (111, 113)  # row 0: its kept token moves the boundary (64 -> 96: residual positions become candidates)


def _decode_int_fields() -> list[str]:
    return [name for name, ctype in native.DecodeArgs._fields_ if ctype is ctypes.c_int64]


def _layer_state(config) -> tuple:
    """A 2-row cache of one tiny layer filled through its own write path (prefill chunks, commits),
    plus a seeded random fetched set and the K/V of a decode pass's new tokens; returns (cache, layer,
    the rows' start positions)."""
    hkv, d = TINY.num_key_value_heads, TINY.head_dim
    config = dataclasses.replace(config, store_dtype="fp32")  # the references' store: fp32, as the layout they hold
    cache = make_cache(TINY, config, len(LENGTHS), max(LENGTHS) + 2, torch.float32, torch.device("cpu"))
    layer = cache.layers[0]
    k_all = [kv_like(1, hkv, n + 2, d, seed=300 + r) for r, n in enumerate(LENGTHS)]
    v_all = [kv_like(1, hkv, n + 2, d, seed=400 + r) for r, n in enumerate(LENGTHS)]
    for r, n in enumerate(LENGTHS):
        for c0 in range(0, n, config.chunk_size):
            t = min(config.chunk_size, n - c0)
            step = cache.begin(slice(r, r + 1), t, prefill=True)
            layer.update(k_all[r][:, :, c0 : c0 + t], v_all[r][:, :, c0 : c0 + t], step)
            cache.commit()
    g = gen(500)
    k = layer.topk
    idx = torch.zeros(len(LENGTHS), hkv, k, dtype=torch.long)
    valid = torch.zeros(len(LENGTHS), hkv, k, dtype=torch.bool)
    for r in range(len(LENGTHS)):
        lo, hi = layer.sinks, int(layer.qend[r])
        for h in range(hkv):
            m = k - 2 * (r == 0)  # row 0: two unused slots
            idx[r, h, :m] = lo + torch.randperm(hi - lo, generator=g)[:m]
            valid[r, h, :m] = True
    layer.store.prefetch(slice(0, len(LENGTHS)), idx)
    layer.fidx.copy_(idx)
    layer.fvalid.copy_(valid)
    # the decode pass's two new tokens of every row (a speculative step writes both; the store keeps
    # one): a pass over fewer rows or with one new token must not see what it does not attend to
    step = cache.begin(slice(0, len(LENGTHS)), 2, keep=1, select=1)
    layer.update(torch.cat([k_all[r][:, :, n : n + 2] for r, n in enumerate(LENGTHS)]),
                 torch.cat([v_all[r][:, :, n : n + 2] for r, n in enumerate(LENGTHS)]), step)
    return cache, layer, step.start


def _fused_case(name: str, base: Case | None, config, rows: slice, t: int, select: int | None, seed: int,
                softcap: float | None = None) -> Case:
    cache, layer, starts = _layer_state(config)
    hkv, d, heads = TINY.num_key_value_heads, TINY.head_dim, TINY.num_attention_heads
    b = rows.stop - rows.start
    step = Step(rows, starts[rows].clone(), t, 1, select)
    q = torch.randn(b, heads, t, d, generator=gen(seed))
    scaling = d**-0.5
    qg = grouped_query(q, hkv).contiguous()
    start = step.start.contiguous()
    a = FusedDecode(layer).args  # the pointers and fixed fields, as the engine builds them
    a.B, a.T, a.row0, a.keep = b, step.n_new, step.rows.start, step.keep
    a.select = -1 if step.select is None else step.select
    a.scaling, a.q_sb, a.q_sh = scaling, qg.stride(0), qg.stride(1)
    c = Case(name, base=base)
    for field in _decode_int_fields():
        if field != "nthreads":  # the check runs each case with 1 and 2 threads
            c[field] = int(getattr(a, field))
    c["scaling"] = float(a.scaling)
    if softcap is not None:  # DecodeArgs.softcap (absent: none)
        c["softcap"] = float(softcap)
    store, guide = layer.store, layer.guide
    buffers = {"q": qg, "start": start, "qend": layer.qend, "sink_k": layer.sink_k, "sink_v": layer.sink_v,
               "res_k": layer.res_k, "res_v": layer.res_v, "fk": store.fk, "fv": store.fv, "fidx": layer.fidx,
               "fvalid": layer.fvalid, "store_k": store.k, "store_v": store.v, "kc": guide.keys.codes,
               "ks": guide.keys.scale, "kz": guide.keys.zero, "vc": guide.values.codes, "vs": guide.values.scale,
               "vz": guide.values.zero}
    if guide.rotation is not None:  # R [D, D] (DecodeArgs.rot; absent: no rotation)
        buffers["rot"] = guide.rotation
    if guide.outliers is not None:  # the outlier channels' side guide (DecodeArgs.O > 0)
        side = guide.outliers
        buffers.update({"oidx": side.idx, "oc": side.codes, "os": side.scale, "oz": side.zero})
    for field, tensor in buffers.items():
        assert tensor.is_contiguous()
        c[field] = tensor.clone()
    # the torch path (native disabled) and the selection weights it ranks (fetch_top's candidates,
    # -1 outside [sinks, bound)): the native selection is checked against them, ties being free
    captured = []
    fetch_top = layer.fetch_top

    def capture(cand, bound, rows_, now=False):
        pos = torch.arange(cand.shape[-1])
        outside = (pos[None, :] >= bound[:, None]) | (pos[None, :] < layer.sinks)
        captured.append(cand.masked_fill(outside[:, None, :], -1.0).clone())
        return fetch_top(cand, bound, rows_, now)

    layer.fetch_top = capture
    with torch.no_grad():
        out = layer.attend_decode(q, scaling, step, softcap)  # [b, T, H, D]
    assert len(captured) == 1, "the pass made no selection"
    c["ref_out"] = out.transpose(1, 2).reshape(b, hkv, heads // hkv * t, d)
    c["ref_sel_w"] = captured[0]
    c["ref_fidx"], c["ref_fvalid"] = layer.fidx[rows], layer.fvalid[rows]
    if config.correct and config.prefetch == "speculative" and t > 1:  # DecodeArgs.reuse summed: [2]
        c["ref_reuse"] = torch.tensor([layer.reused, layer.reuse_total], dtype=torch.long)
    cache.close()
    return c


def fused_cases() -> list[Case]:
    spec = CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=16,
                       rotation="none", outliers=0)  # the rotations and the outliers: their own cases below
    base = _fused_case("fused:spec_2bit", None, spec, slice(0, 2), 2, 1, seed=600)
    return [base,
            _fused_case("fused:spec_select_both", base, dataclasses.replace(spec, select_both=True), slice(0, 2), 2, 1,
                        seed=601),
            _fused_case("fused:spec_1bit_k8_nosinks", base, dataclasses.replace(spec, bits=1, k=8, sinks=0),
                        slice(0, 2), 2, 1, seed=602),
            _fused_case("fused:current_row1", base, dataclasses.replace(spec, prefetch="current"), slice(1, 2), 1,
                        None, seed=603),
            _fused_case("fused:spec_uncorrected", base, dataclasses.replace(spec, correct=False), slice(0, 2), 2, 1,
                        seed=604),
            _fused_case("fused:spec_1bit_hadamard", base, dataclasses.replace(spec, bits=1, rotation="hadamard"),
                        slice(0, 2), 2, 1, seed=605),
            _fused_case("fused:current_hadamard", base,
                        dataclasses.replace(spec, prefetch="current", rotation="hadamard"), slice(0, 2), 1, None,
                        seed=606),
            _fused_case("fused:current_1bit_outliers", base,
                        dataclasses.replace(spec, bits=1, prefetch="current", rotation="hadamard", outliers=3),
                        slice(0, 2), 1, None, seed=607),
            # a small softcap (Gemma 2's is 50 on scores of a few units): most scores are bent by it
            _fused_case("fused:spec_softcap", base, spec, slice(0, 2), 2, 1, seed=608, softcap=1.5),
            _fused_case("fused:current_softcap", base, dataclasses.replace(spec, prefetch="current"), slice(0, 2), 1,
                        None, seed=609, softcap=1.5)]


def _sliding_case(name: str, base: Case | None, rows: slice, softcap: float | None, seed: int) -> Case:
    """A sliding-window layer (engine/kvcache/sliding.py) of the tiny GQA shape, window 24, its two rows filled
    through its own update (7 and 61 tokens in prefill chunks of 16: the longer row's ring wraps), then a decode
    pass writing two new tokens per row; queries of `rows` attend (the reference: attend_torch's output). The
    ring is the same in every case (stored once, in the base case)."""
    hkv, d, heads = TINY.num_key_value_heads, TINY.head_dim, TINY.num_attention_heads
    lengths, t = [7, 61], 2
    g = gen(700)
    layer = SlidingWindowLayer.build(ModelShape(1, heads, hkv, d), CacheConfig(mode="full", chunk_size=16),
                                     len(lengths), 400, torch.float32, torch.device("cpu"),
                                     Transfer(torch.device("cpu")), window=24)
    for r, n in enumerate(lengths):
        for p0 in range(0, n, 16):
            m = min(16, n - p0)
            step = Step(slice(r, r + 1), torch.tensor([p0]), m, m, prefill=True)
            layer.update(torch.randn(1, hkv, m, d, generator=g), torch.randn(1, hkv, m, d, generator=g), step)
    step = Step(slice(0, 2), torch.tensor(lengths), t, 1, 0)
    layer.update(torch.randn(2, hkv, t, d, generator=g), torch.randn(2, hkv, t, d, generator=g), step)
    b = rows.stop - rows.start
    step = Step(rows, torch.tensor(lengths[rows]), t, 1, 0)
    q = torch.randn(b, heads, t, d, generator=gen(seed)) * 2
    scaling = d**-0.5
    c = Case(name, base=base)
    for field, value in (("B", b), ("H", hkv), ("G", heads // hkv), ("T", t), ("D", d), ("C", layer.capacity),
                         ("W", layer.window), ("row0", rows.start)):
        c[field] = int(value)
    c["scaling"] = float(scaling)
    c["softcap"] = float(softcap or 0.0)  # (always written: a case's absent field is its base case's)
    c["q"] = grouped_query(q, hkv).contiguous()
    c["k"], c["v"], c["pos"], c["start"] = layer.k.clone(), layer.v.clone(), layer.pos.clone(), step.start.clone()
    with torch.no_grad():
        out = layer.attend_torch(q, scaling, step, softcap)  # [b, T, H, D]
    c["ref_out"] = out.transpose(1, 2).reshape(b, hkv, heads // hkv * t, d)
    return c


def sliding_cases() -> list[Case]:
    base = _sliding_case("sliding:two_rows_softcapped", None, slice(0, 2), 1.5, seed=701)
    return [base, _sliding_case("sliding:row_1", base, slice(1, 2), None, seed=702)]


# -------------------------------------------------------------------------------- main


FILES = {"linear.bin": linear_cases, "guide.bin": guide_cases, "fused.bin": lambda: fused_cases() + sliding_cases()}


def make(out: Path) -> list[Path]:
    """Write every reference file into out; returns their paths. Needs the native library off
    ($SPECACHE_NATIVE=0 before its first use in the process: main() sets it)."""
    assert native.lib() is None, "the references must come from the torch paths: run with SPECACHE_NATIVE=0"
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in FILES.items():
        write(out / name, build())
        paths.append(out / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"folder (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    os.environ[native.ENV_DISABLE] = "0"  # torch references only (read at the first use of engine.native)
    for path in make(args.out):
        print(f"{path}: {path.stat().st_size} bytes, {len(read(path))} blobs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
