"""The fused guided decode's selection kernels (their launch code and the contract: engine/backends/triton_decode.py;
the attention's: decode_kernels.py, whose helpers they share): the selecting queries' weights of each split's
guide-only positions kept as a compact candidate list, and the next fetched set chosen from every list on the
device and written in place (no torch op around them, no value read on the host)."""
import triton
import triton.language as tl

from engine.backends.triton_code.decode_kernels import _block, _head_queries, _keys, _weights


@triton.jit
def _top(run, keys, CP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The CP largest of the running candidates run [CP] and a block's keys [BLOCK_N] (CP >= BLOCK_N)."""
    R: tl.constexpr = CP // BLOCK_N
    r = tl.arange(0, R)
    staged = tl.reshape(tl.where((r == 0)[:, None], keys[None, :], -1), (CP,))
    both = tl.sort(tl.reshape(tl.join(run, staged), (2 * CP,)), descending=True)
    top, _ = tl.split(tl.trans(tl.reshape(both, (2, CP))))
    return top


@triton.jit
def select_weights_kernel(q_ptr, r_ptr, q_sb, q_sh, kc, kc_sb, kc_sh, ks, kz, ks_sb, ks_sh, oi, oi_sb, oi_sh, oc,
                          oc_sb, oc_sh, os_, oz, os_sb, os_sh, fm, fm_sb, fm_sh, qend_ptr, stat_ptr, cand, cand_sb, H,
                          M, D, S, O, T, sel, SPLIT, scaling, softcap, G: tl.constexpr, BITS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MP: tl.constexpr, OP: tl.constexpr,
                          CP: tl.constexpr, HAS_OUT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISE: tl.constexpr,
                          ROT: tl.constexpr, RC: tl.constexpr):
    """The next step's candidates of one (row, KV head, split): the selecting queries' probabilities in the one
    softmax (decode_merge_kernel's max and sum), summed per position over the guide-only positions (the fetched
    ones by guide_split_kernel's map); the split's CP largest kept as it goes (a sort of the running list and each
    block) and written as candidate keys (_keys) at cand[row*KV head] + split * CP (decode_merge_kernel writes
    the fetched positions' and the residual slots' after the splits')."""
    bh, sp = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, d = tl.arange(0, MP), tl.arange(0, BLOCK_D)
    dm = d < D
    q, ch, qo = _head_queries(q_ptr, r_ptr, q_sb, q_sh, oi, oi_sb, oi_sh, b, h, rows, d, M, D, O, OP, ROT, RC)
    picks = (rows < M) & ((rows % T == sel) | (sel < 0))
    m, l_all = tl.load(stat_ptr + 2 * bh * MP + rows), tl.load(stat_ptr + 2 * bh * MP + MP + rows)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, tl.load(qend_ptr + b).to(tl.int32))
    run = tl.full((CP,), -1, tl.int64)
    for n0 in range(lo, hi, BLOCK_N):
        tok, s, held = _block(q, qo, kc + b * kc_sb + h * kc_sh, ks + b * ks_sb + h * ks_sh, kz + b * ks_sb + h * ks_sh,
                              oc + b * oc_sb + h * oc_sh, os_ + b * os_sb + h * os_sh, oz + b * os_sb + h * os_sh,
                              fm + b * fm_sb + h * fm_sh, n0, hi, d, dm, D, O, scaling, softcap, G, BITS, BLOCK_N, OP,
                              HAS_OUT, SOFTCAP, PRECISE)
        run = _top(run, _keys(_weights(s, picks, m, l_all), tok, (tok < hi) & (tok >= S) & (held == 0)), CP, BLOCK_N)
    tl.store(cand + bh * cand_sb + sp * CP + tl.arange(0, CP), run)


@triton.jit
def select_top_kernel(cand, NC, start_ptr, fi, fok, fi_sb, fi_sh, H, S, K, keep, residual, group, KP: tl.constexpr):
    """The next fetched set of one (row, KV head): the K largest of its NC candidate keys (every split's list and
    the exact positions') at positions in [S, bound), bound the row's quantized prefix after the pass
    (quant_boundary of start + keep), written in place: fi the positions (0 in unused slots), fok 1 where valid."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    bound = tl.maximum(tl.load(start_ptr + b).to(tl.int32) + keep - residual, 0) // group * group
    i = tl.arange(0, KP)
    run = tl.full((KP,), -1, tl.int64)
    for c0 in range(0, NC, KP):
        keys = tl.load(cand + bh * NC + c0 + i, mask=c0 + i < NC, other=-1)
        pos = (keys & 0xFFFFFFFF).to(tl.int32)
        run = _top(run, tl.where((keys >= 0) & (pos >= S) & (pos < bound), keys, -1), KP, KP)
    valid = run >= 0
    at = b * fi_sb + h * fi_sh + i
    tl.store(fi + at, tl.where(valid, run & 0xFFFFFFFF, 0), mask=i < K)
    tl.store(fok + at, valid.to(tl.int8), mask=i < K)
