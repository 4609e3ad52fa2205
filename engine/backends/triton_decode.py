"""A guided layer's decode pass in Triton kernels (CUDA; Triton's interpreter in the tests): what
GuidedLayer.attend_decode and select_and_prefetch compute with ~30 torch ops, and the CPU's native call
(engine/backends/native_fused.py) in one, here flash-decoding over split blocks of the guide:

1. guide_split_kernel, per (row, KV head, split of the guide region): scores of the grouped queries against
   the packed 1/2-bit key codes (and the 4-bit outlier channels) on the tensor cores, fp16 operands and fp32
   sums, never a dequantized copy nor a score tensor in memory; the split's softmax max and sum and its
   guide-values accumulator over the guide-only positions (not a sink, not fetched, below the row's qend).
2. decode_merge_kernel, per (row, KV head): exact scores at the sinks, the fetched set and the residual window
   (causal per new token), one softmax with the splits' statistics, exact + guide values -> the output, and
   the softmax's final max and sum per query; with a selecting token, the selecting queries' weights (their
   probabilities summed) of the fetched positions and the residual slots, as candidates.
3. With a selecting token: select_weights_kernel, per (row, KV head, split): the selecting queries' weights of
   the split's guide-only positions, of which it keeps the CP best (CP: k rounded up to a power of two; a
   running sorted list) as a compact candidate list (weight and position packed in one int64); then torch's
   top-k over the candidates of every split and the exact ones, in [sinks, next qend) -> the next fetched
   set (the same set as a top-k over every position: no split holds more than CP of the k best).

Around the kernels, torch ops on small tensors: the map of fetched positions (zeros + scatter), the queries
made fp32 (and rotated), the rotated guide output (matmul), and the top-k over the candidates.

The contract is GuidedLayer's (tests/test_triton_decode.py checks it against the torch code): queries
[b, H_kv, G*T, D] grouped as passes.grouped_query groups them; a guide rotation R rotates the queries for
the main guide's scores (the outlier channels are scored with the unrotated queries) and the guide's value
output back by R^T (a matmul after the merge); softcap caps every score before the one softmax.
Rows may differ in length: qend [b] (each row's guide region) and start [b] (each row's first new
position) are read on the device; nq, the longest guide region, only sizes the grid."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from engine.backends.triton_guide import MIN_DOT, _padded, launch

PROGRAMS = 256  # splits per pass: enough (row, KV head, split) programs for this many at least
# the guide's key dots split the scaled queries into two fp16 parts (PRECISE) up to this head size (past it,
# the second dot's registers spill: one fp16 dot, scores to fp16's rounding of the scaled queries)
PRECISE_HEAD = 128
EXACT_BLOCK = 16  # exact keys per block of the merge (more: spills at head_dim 128)


@dataclass
class DecodeBuffers:
    """A guided layer's buffers as the decode reads them: the guide (keys, values, outlier channels or None,
    rotation or None), the sinks [B, H, S', D] (the first S positions), the fetched set fk / fv [B, H, K, D]
    at positions fidx [B, H, K] where fvalid, the residual window res_k / res_v [B, H, W, D] (slot j at
    position qend + j), and each row's qend [B] (long)."""

    keys: object  # engine.kvcache.codes.QuantizedKeys
    values: object  # engine.kvcache.codes.QuantizedValues
    outliers: object | None  # engine.kvcache.outliers.OutlierKeys
    rotation: torch.Tensor | None
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sinks: int
    fk: torch.Tensor
    fv: torch.Tensor
    fidx: torch.Tensor
    fvalid: torch.Tensor
    res_k: torch.Tensor
    res_v: torch.Tensor
    qend: torch.Tensor


@dataclass
class DecodePass:
    """One pass: grouped queries q [b, H, G*T, D] of rows [row0, row0 + b), T new tokens, each row's first new
    position start [b]; scaling and softcap (or None); nq the longest guide region among the rows; select: the
    new token whose probabilities pick the next fetched set (None: no selection; select_both: both tokens'),
    among positions [sinks, bound[b]) (bound: each row's qend after the pass), k of them."""

    q: torch.Tensor
    start: torch.Tensor
    tokens: int
    scaling: float
    nq: int
    row0: int = 0
    softcap: float | None = None
    select: int | None = None
    select_both: bool = False
    bound: torch.Tensor | None = None


@functools.lru_cache(maxsize=1)
def kernels():
    """(split, merge, select) kernels of engine/backends/triton_code/decode_kernels.py, or None without Triton."""
    try:
        mod = importlib.import_module("engine.backends.triton_code.decode_kernels")
    except ImportError:
        return None
    return mod.guide_split_kernel, mod.decode_merge_kernel, mod.select_weights_kernel


def _rows(t: torch.Tensor, p: DecodePass) -> torch.Tensor:
    return t[p.row0 : p.row0 + p.q.shape[0]]


def _geometry(buf: DecodeBuffers, p: DecodePass) -> dict:
    """Block and split sizes of a pass: BLOCK_N tokens inside one key group, splits of whole blocks."""
    b, h, m, d = p.q.shape
    block = min(buf.keys.group, 64 if d <= 128 else 32)  # (a head of 256: half the tile, in registers)
    blocks = max(1, -(-p.nq // block))
    splits = max(1, min(blocks, -(-PROGRAMS // (b * h))))
    per = -(-blocks // splits) * block
    return {"block": block, "splits": max(1, -(-max(p.nq, 1) // per)), "per": per, "mp": _padded(m, MIN_DOT),
            "bd": _padded(d, MIN_DOT), "op": MIN_DOT, "warps": 4 if d <= 64 else 8,
            "cp": _padded(max(buf.fidx.shape[2], block), 1), "precise": d <= PRECISE_HEAD}


def _held(buf: DecodeBuffers, p: DecodePass) -> torch.Tensor:
    """int8 [b, H, capacity + 1]: 1 at each valid fetched position (the guide part skips them)."""
    b, h = p.q.shape[:2]
    cap = buf.keys.capacity
    held = torch.zeros(b, h, cap + 1, dtype=torch.int8, device=p.q.device)
    idx = torch.where(_rows(buf.fvalid, p), _rows(buf.fidx, p).clamp(max=cap), cap)
    return held.scatter_(-1, idx, 1)


def _outlier_args(buf: DecodeBuffers, p: DecodePass, held: torch.Tensor) -> tuple:
    """(idx, codes, scale, zero) of the outlier channels and their count; stand-ins (never read) without."""
    side = buf.outliers
    if side is None:
        z = held[:, :, :1]
        return (z, z, z, z), 0
    return (_rows(side.idx, p), _rows(side.codes, p), _rows(side.scale, p), _rows(side.zero, p)), side.count


def _guide_args(buf: DecodeBuffers, p: DecodePass, q: torch.Tensor, qr: torch.Tensor, held: torch.Tensor) -> list:
    """The arguments the split and select kernels share, up to the fetched-position map: queries (unrotated,
    rotated), key codes, scale, zero, outlier idx / codes / scale / zero, the map."""
    k = buf.keys
    kc, ks, kz = _rows(k.codes, p), _rows(k.scale, p), _rows(k.zero, p)
    (oi, oc, os_, oz), _ = _outlier_args(buf, p, held)
    return [q, qr, q.stride(0), q.stride(1), kc, kc.stride(0), kc.stride(1), ks, kz, ks.stride(0), ks.stride(1)], \
        [oi, oi.stride(0), oi.stride(1), oc, oc.stride(0), oc.stride(1), os_, oz, os_.stride(0), os_.stride(1),
         held, held.stride(0), held.stride(1)]


def _queries(buf: DecodeBuffers, p: DecodePass) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries fp32 contiguous, and rotated by the guide's R (the same tensor without one)."""
    q = p.q.float().contiguous()
    return q, (q @ buf.rotation).contiguous() if buf.rotation is not None else q


def _split(buf: DecodeBuffers, p: DecodePass, q, qr, held, geo: dict):
    """Launch 1 -> (max and sum [splits, b*H, 2, MP], accumulators [splits, b*H, MP, BLOCK_D])."""
    b, h, m, d = p.q.shape
    v = buf.values
    vc, vs, vz = _rows(v.codes, p), _rows(v.scale, p), _rows(v.zero, p)
    ml = torch.empty(geo["splits"], b * h, 2, geo["mp"], dtype=torch.float32, device=q.device)
    acc = torch.empty(geo["splits"], b * h, geo["mp"], geo["bd"], dtype=torch.float32, device=q.device)
    head, side = _guide_args(buf, p, q, qr, held)
    _, count = _outlier_args(buf, p, held)
    ok = launch(
        "decode", kernels()[0], (b * h, geo["splits"]), *head, vc, vc.stride(0), vc.stride(1), vs, vz, vs.stride(0), vs.stride(1), *side, _rows(buf.qend, p), ml, acc,
        h, m, d, buf.sinks, count, geo["per"], p.scaling, p.softcap or 0.0, G=buf.keys.group, GV=v.group,
        BITS=buf.keys.bits, BLOCK_N=geo["block"], BLOCK_D=geo["bd"], MP=geo["mp"], OP=geo["op"],
        HAS_OUT=count > 0, SOFTCAP=p.softcap is not None, PRECISE=geo["precise"], num_warps=geo["warps"])
    return (ml, acc) if ok else None


def _exact_args(buf: DecodeBuffers, p: DecodePass) -> list:
    """The exact part's buffers as the merge kernel takes them (sinks, fetched set and its positions, residual)."""
    sk, sv, fk, fv = (_rows(t, p) for t in (buf.sink_k, buf.sink_v, buf.fk, buf.fv))
    fi, fok, rk, rv = _rows(buf.fidx, p), _rows(buf.fvalid, p).view(torch.int8), _rows(buf.res_k, p), _rows(buf.res_v, p)
    return [sk, sv, sk.stride(0), sk.stride(1), fk, fv, fk.stride(0), fk.stride(1), fi, fok, fi.stride(0),
            fi.stride(1), rk, rv, rk.stride(0), rk.stride(1)]


def _selects(p: DecodePass) -> bool:
    return p.select is not None or p.select_both


def _candidates(buf: DecodeBuffers, p: DecodePass, geo: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate lists of a selecting pass (int64 keys, engine/backends/triton_code/decode_kernels.py's _keys):
    the guide's, the CP best of each split [b*H, splits, CP], and the exact positions' [b*H, K + W]; stand-ins
    (never written) otherwise."""
    b, h = p.q.shape[:2]
    if not _selects(p):
        none = torch.empty(1, dtype=torch.int64, device=p.q.device)
        return none, none
    return (torch.empty(b * h, geo["splits"], geo["cp"], dtype=torch.int64, device=p.q.device),
            torch.empty(b * h, buf.fidx.shape[2] + buf.res_k.shape[2], dtype=torch.int64, device=p.q.device))


def _merge(buf: DecodeBuffers, p: DecodePass, q, ml, acc, cand, geo: dict):
    """Launch 2 -> (output fp32 [b, H, G*T, D], the softmax's (max, sum) [b*H, 2, MP]); the exact positions'
    candidates into cand."""
    b, h, m, d = p.q.shape
    out = torch.empty(b, h, m, d, dtype=torch.float32, device=q.device)
    guide = torch.empty_like(out) if buf.rotation is not None else out
    stat = torch.empty(b * h, 2, geo["mp"], dtype=torch.float32, device=q.device)
    ok = launch(
        "decode", kernels()[1], (b * h,), q, q.stride(0), q.stride(1), *_exact_args(buf, p), _rows(buf.qend, p), p.start, ml, acc, out, guide, stat,
        cand, ml.shape[0], h, m, d, min(buf.sinks, buf.sink_k.shape[2]), buf.fidx.shape[2],
        buf.res_k.shape[2], p.tokens, -1 if p.select_both else (p.select or 0), p.scaling, p.softcap or 0.0,
        MP=geo["mp"], BLOCK_D=geo["bd"], BLOCK_E=EXACT_BLOCK, SOFTCAP=p.softcap is not None,
        ROT=buf.rotation is not None, SELECT=_selects(p), num_warps=4)
    if not ok:
        return None
    if buf.rotation is not None:
        out += guide @ buf.rotation.T
    return out, stat


def _select(buf: DecodeBuffers, p: DecodePass, q, qr, held, stat, cand, geo: dict) -> bool:
    """Launch 3: each split's best guide-only positions for the selecting queries into cand."""
    b, h, m, d = p.q.shape
    head, side = _guide_args(buf, p, q, qr, held)
    _, count = _outlier_args(buf, p, held)
    return launch(
        "decode", kernels()[2], (b * h, geo["splits"]), *head, *side, _rows(buf.qend, p), stat, cand, h, m, d, buf.sinks, count, p.tokens,
        -1 if p.select_both else p.select, geo["per"], p.scaling, p.softcap or 0.0, G=buf.keys.group,
        BITS=buf.keys.bits, BLOCK_N=geo["block"], BLOCK_D=geo["bd"], MP=geo["mp"], OP=geo["op"], CP=geo["cp"],
        HAS_OUT=count > 0, SOFTCAP=p.softcap is not None, PRECISE=geo["precise"], num_warps=geo["warps"])


def unpack(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate keys (int64) -> (weights fp32, -1 where none; positions long)."""
    w = (keys >> 32).to(torch.int32).view(torch.float32)
    return torch.where(keys < 0, -1.0, w), keys & 0xFFFFFFFF


def top_positions(keys: torch.Tensor, bound: torch.Tensor, sinks: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k candidates of largest weight among keys [b, H, n] (unpack) at positions in [sinks, bound[b]) ->
    (idx [b, H, k] long, 0 in unused slots; valid [b, H, k] bool), as SpecacheLayer.top_positions pads them."""
    b, h, n = keys.shape
    w, pos = unpack(keys)
    w = w.masked_fill((pos >= bound[:, None, None]) | (pos < sinks), -1.0)
    top, at = w.topk(min(k, n), dim=-1, sorted=False)
    valid = top >= 0
    idx = pos.gather(-1, at).masked_fill(~valid, 0)
    if idx.shape[-1] < k:
        pad = k - idx.shape[-1]
        idx, valid = torch.cat([idx, idx.new_zeros(b, h, pad)], -1), torch.cat([valid, valid.new_zeros(b, h, pad)], -1)
    return idx, valid


def decode(buf: DecodeBuffers, p: DecodePass) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """One guided decode pass (module docstring) -> (output fp32 [b, H, G*T, D], the next fetched set
    (idx, valid) [b, H, k] when p.select or p.select_both, else None), or None where a kernel failed to launch
    (said once on stderr by triton_guide.launch; the caller computes the pass otherwise)."""
    if kernels() is None:
        raise RuntimeError("the fused Triton decode needs Triton")
    geo = _geometry(buf, p)
    q, qr = _queries(buf, p)
    held = _held(buf, p)
    parts = _split(buf, p, q, qr, held, geo)
    guide_cand, exact_cand = _candidates(buf, p, geo)
    merged = parts and _merge(buf, p, q, *parts, exact_cand, geo)
    if not merged or not _selects(p):
        return (merged[0], None) if merged else None
    out, stat = merged
    if not _select(buf, p, q, qr, held, stat, guide_cand, geo):
        return None
    b, h = p.q.shape[:2]
    keys = torch.cat([guide_cand.view(b, h, -1), exact_cand.view(b, h, -1)], dim=-1)
    return out, top_positions(keys, p.bound, buf.sinks, buf.fidx.shape[2])
