"""A guided layer's decode pass in Triton kernels (CUDA; Triton's interpreter in the tests): what
GuidedLayer.attend_decode and select_and_prefetch compute with ~30 torch ops, and the CPU's native call
(engine/backends/native_fused.py) in one, here flash-decoding over split blocks of the guide:

1. guide_split_kernel, per (row, KV head, split of the guide region): the map of fetched positions of its range
   (int8, written and read by the split's own program), then scores of the grouped queries (rotated by the
   guide's R in the kernel) against the packed 1/2-bit key codes (and the 4-bit outlier channels) on the tensor
   cores, fp16 operands and fp32 sums, never a dequantized copy nor a score tensor in memory; the split's
   softmax max and sum and its guide-values accumulator over the guide-only positions (not a sink, not fetched,
   below the row's qend).
2. decode_merge_kernel, per (row, KV head): exact scores at the sinks, the fetched set and the residual window
   (causal per new token), one softmax with the splits' statistics, exact + guide values (rotated back by R^T
   in the kernel) -> the output, and the softmax's final max and sum per query; with a selecting token, the
   selecting queries' weights (their probabilities summed) of the fetched positions and the residual slots, as
   candidates.
3. With a selecting token: select_weights_kernel, per (row, KV head, split): the selecting queries' weights of
   the split's guide-only positions, of which it keeps the CP best (CP: k rounded up to a power of two; a
   running sorted list) as a compact candidate list (weight and position packed in one int64).
4. select_top_kernel, per (row, KV head): the k best of every split's list and the exact positions', in
   [sinks, next qend) (computed from start + keep on the device) -> the next fetched set, written into the
   layer's fidx / fvalid (the same set as a top-k over every position: no split holds more than CP of the k best).

No torch op runs around the kernels (allocations only; a contiguous copy of the queries where they are not) and
no value is read on the host: a selecting pass is four launches, a pass without selection two; the pass's new
K/V went into the residual window and the sinks before, in one launch (write_recent, from GuidedLayer.update).

The contract is GuidedLayer's (tests/test_triton_decode.py checks it against the torch code): queries
[b, H_kv, G*T, D] grouped as passes.grouped_query groups them; a guide rotation R rotates the queries for
the main guide's scores (the outlier channels are scored with the unrotated queries) and the guide's value
output back by R^T; softcap caps every score before the one softmax.
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
    residual: int  # the exact recent tokens (with the key group, what a row's quantized prefix is: quant_boundary)


@dataclass
class DecodePass:
    """One pass: grouped queries q [b, H, G*T, D] of rows [row0, row0 + b), T new tokens, each row's first new
    position start [b]; scaling and softcap (or None); nq the longest guide region among the rows; select: the
    new token whose probabilities pick the next fetched set (None: no selection; select_both: both tokens'),
    among positions [sinks, bound[b]), k of them (bound: each row's qend after the pass, quant_boundary of
    start + keep, computed by the kernel that picks them)."""

    q: torch.Tensor
    start: torch.Tensor
    tokens: int
    scaling: float
    nq: int
    row0: int = 0
    softcap: float | None = None
    select: int | None = None
    select_both: bool = False
    keep: int = 0


@functools.lru_cache(maxsize=1)
def kernels():
    """(split, merge, select, top, write) kernels of engine/backends/triton_code/ (decode_kernels.py,
    select_kernels.py), or None without Triton."""
    try:
        mod = importlib.import_module("engine.backends.triton_code.decode_kernels")
        sel = importlib.import_module("engine.backends.triton_code.select_kernels")
    except ImportError:
        return None
    return (mod.guide_split_kernel, mod.decode_merge_kernel, sel.select_weights_kernel, sel.select_top_kernel,
            mod.write_recent_kernel)


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


def _shared(buf: DecodeBuffers, p: DecodePass, geo: dict) -> dict:
    """The launch options the guide's kernels (split, select) share."""
    return {"G": buf.keys.group, "BITS": buf.keys.bits, "BLOCK_N": geo["block"], "BLOCK_D": geo["bd"],
            "MP": geo["mp"], "OP": geo["op"], "HAS_OUT": buf.outliers is not None, "SOFTCAP": p.softcap is not None,
            "PRECISE": geo["precise"], "ROT": buf.rotation is not None, "RC": MIN_DOT, "num_warps": geo["warps"]}


def _guide_args(buf: DecodeBuffers, p: DecodePass, q: torch.Tensor, fmap: torch.Tensor) -> tuple[list, list]:
    """The arguments the split and select kernels share, up to the fetched-position map: queries, the rotation
    (the queries again without one: never read), key codes, scale, zero; outlier idx / codes / scale / zero
    (stand-ins, never read, without), the map."""
    k, side = buf.keys, buf.outliers
    kc, ks, kz = _rows(k.codes, p), _rows(k.scale, p), _rows(k.zero, p)
    if side is None:
        oi = oc = os_ = oz = fmap[:, :, :1]
    else:
        oi, oc, os_, oz = (_rows(t, p) for t in (side.idx, side.codes, side.scale, side.zero))
    rot = buf.rotation if buf.rotation is not None else q
    return [q, rot, q.stride(0), q.stride(1), kc, kc.stride(0), kc.stride(1), ks, kz, ks.stride(0), ks.stride(1)], \
        [oi, oi.stride(0), oi.stride(1), oc, oc.stride(0), oc.stride(1), os_, oz, os_.stride(0), os_.stride(1),
         fmap, fmap.stride(0), fmap.stride(1)]


def _fetched(buf: DecodeBuffers, p: DecodePass) -> list:
    """The fetched set's positions and validity (int8) of the pass's rows, with their strides."""
    fi, fok = _rows(buf.fidx, p), _rows(buf.fvalid, p).view(torch.int8)
    return [fi, fok, fi.stride(0), fi.stride(1)]


def _split(buf: DecodeBuffers, p: DecodePass, q, fmap, geo: dict):
    """Launch 1 -> (max and sum [splits, b*H, 2, MP], accumulators [splits, b*H, MP, BLOCK_D]); the map of
    fetched positions written."""
    b, h, m, d = p.q.shape
    v = buf.values
    vc, vs, vz = _rows(v.codes, p), _rows(v.scale, p), _rows(v.zero, p)
    ml = torch.empty(geo["splits"], b * h, 2, geo["mp"], dtype=torch.float32, device=q.device)
    acc = torch.empty(geo["splits"], b * h, geo["mp"], geo["bd"], dtype=torch.float32, device=q.device)
    head, side = _guide_args(buf, p, q, fmap)
    count = buf.outliers.count if buf.outliers is not None else 0
    ok = launch(
        "decode", kernels()[0], (b * h, geo["splits"]), *head, vc, vc.stride(0), vc.stride(1), vs, vz, vs.stride(0),
        vs.stride(1), *side, *_fetched(buf, p), _rows(buf.qend, p), ml, acc, h, m, d, buf.sinks, count,
        buf.fidx.shape[2], geo["per"], p.scaling, p.softcap or 0.0, GV=v.group, KB=MIN_DOT, **_shared(buf, p, geo))
    return (ml, acc) if ok else None


def _exact_args(buf: DecodeBuffers, p: DecodePass) -> list:
    """The exact part's buffers as the merge kernel takes them (sinks, fetched set and its positions, residual)."""
    sk, sv, fk, fv = (_rows(t, p) for t in (buf.sink_k, buf.sink_v, buf.fk, buf.fv))
    rk, rv = _rows(buf.res_k, p), _rows(buf.res_v, p)
    return [sk, sv, sk.stride(0), sk.stride(1), fk, fv, fk.stride(0), fk.stride(1), *_fetched(buf, p), rk, rv,
            rk.stride(0), rk.stride(1)]


def _selects(p: DecodePass) -> bool:
    return p.select is not None or p.select_both


def _candidates(buf: DecodeBuffers, p: DecodePass, geo: dict) -> torch.Tensor:
    """The candidate keys of a selecting pass (int64, decode_kernels.py's _keys) [b*H, splits * CP + K + W]: the CP
    best of each split, then the exact positions'; a stand-in (never written) otherwise."""
    b, h = p.q.shape[:2]
    n = geo["splits"] * geo["cp"] + buf.fidx.shape[2] + buf.res_k.shape[2] if _selects(p) else 1
    return torch.empty(b * h if _selects(p) else 1, n, dtype=torch.int64, device=p.q.device)


def _merge(buf: DecodeBuffers, p: DecodePass, q, ml, acc, cand, geo: dict):
    """Launch 2 -> (output fp32 [b, H, G*T, D], the softmax's (max, sum) [b*H, 2, MP]); the exact positions'
    candidates into cand (after the splits')."""
    b, h, m, d = p.q.shape
    out = torch.empty(b, h, m, d, dtype=torch.float32, device=q.device)
    stat = torch.empty(b * h, 2, geo["mp"], dtype=torch.float32, device=q.device)
    exact = cand[:, geo["splits"] * geo["cp"]:] if _selects(p) else cand
    ok = launch(
        "decode", kernels()[1], (b * h,), q, q.stride(0), q.stride(1), *_exact_args(buf, p), _rows(buf.qend, p),
        p.start, ml, acc, out, buf.rotation if buf.rotation is not None else q, stat, exact, cand.stride(0),
        ml.shape[0], h, m, d, min(buf.sinks, buf.sink_k.shape[2]), buf.fidx.shape[2], buf.res_k.shape[2], p.tokens,
        -1 if p.select_both else (p.select or 0), p.scaling, p.softcap or 0.0, MP=geo["mp"], BLOCK_D=geo["bd"],
        BLOCK_E=EXACT_BLOCK, SOFTCAP=p.softcap is not None, ROT=buf.rotation is not None, SELECT=_selects(p),
        RC=MIN_DOT, num_warps=4)
    return (out, stat) if ok else None


def _select(buf: DecodeBuffers, p: DecodePass, q, fmap, stat, cand, geo: dict) -> bool:
    """Launch 3: each split's best guide-only positions for the selecting queries into cand."""
    b, h, m, d = p.q.shape
    head, side = _guide_args(buf, p, q, fmap)
    count = buf.outliers.count if buf.outliers is not None else 0
    return launch(
        "decode", kernels()[2], (b * h, geo["splits"]), *head, *side, _rows(buf.qend, p), stat, cand, cand.stride(0),
        h, m, d, buf.sinks, count, p.tokens, -1 if p.select_both else p.select, geo["per"], p.scaling,
        p.softcap or 0.0, CP=geo["cp"], **_shared(buf, p, geo))


def _top(buf: DecodeBuffers, p: DecodePass, cand: torch.Tensor) -> bool:
    """Launch 4: the next fetched set from the candidates, written into buf.fidx / buf.fvalid."""
    b, h = p.q.shape[:2]
    k = buf.fidx.shape[2]
    fi, fok, fi_sb, fi_sh = _fetched(buf, p)
    return launch("decode", kernels()[3], (b * h,), cand, cand.shape[1], p.start, fi, fok, fi_sb, fi_sh, h,
                  buf.sinks, k, p.keep, buf.residual, buf.keys.group, KP=_padded(k, MIN_DOT), num_warps=4)


def decode(buf: DecodeBuffers, p: DecodePass) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """One guided decode pass (module docstring) -> (output fp32 [b, H, G*T, D], the next fetched set
    (idx, valid) [b, H, k]: the pass's rows of buf.fidx / buf.fvalid, written in place, when p.select or
    p.select_both, else None), or None where a kernel failed to launch (said once on stderr by
    triton_guide.launch; the caller computes the pass otherwise)."""
    if kernels() is None:
        raise RuntimeError("the fused Triton decode needs Triton")
    geo = _geometry(buf, p)
    b, h = p.q.shape[:2]
    q = p.q.contiguous()
    fmap = torch.empty(b, h, max(buf.keys.capacity, 1), dtype=torch.int8, device=q.device)
    parts = _split(buf, p, q, fmap, geo)
    cand = _candidates(buf, p, geo)
    merged = parts and _merge(buf, p, q, *parts, cand, geo)
    if not merged or not _selects(p):
        return (merged[0], None) if merged else None
    out, stat = merged
    if not (_select(buf, p, q, fmap, stat, cand, geo) and _top(buf, p, cand)):
        return None
    return out, (_rows(buf.fidx, p), _rows(buf.fvalid, p))


def write_recent(k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, qend: torch.Tensor,
                 into: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], sinks: int) -> bool:
    """A pass's new K/V [b, H, T, D] of rows whose first new positions are start [b] written in one launch into
    `into` (res_k, res_v [b, H, W, D], sink_k, sink_v [b, H, S', D]): each token into its residual slot
    (position - qend [b]) and, at positions below sinks, into the sinks; every index read on the device.
    -> False where the launch failed (the caller's torch writes run)."""
    b, h, t, d = k.shape
    res_k, res_v, sink_k, sink_v = into
    return launch("decode", kernels()[4], (b * h,), k, v, *k.stride(), *v.stride(), start, qend, res_k, res_v,
                  res_k.stride(0), res_k.stride(1), sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), h, t, d,
                  min(sinks, sink_k.shape[2]), BLOCK_T=_padded(t, 1), BLOCK_D=_padded(d, MIN_DOT), num_warps=4)
