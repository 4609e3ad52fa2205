"""The fused guided decode's Triton kernels (their launch code, the contract and the layout:
engine/backends/triton_decode.py). Imported only where they run (CUDA, or Triton's interpreter in the tests).

The guide's dots take fp16 operands on the tensor cores with fp32 accumulation: the key codes are small
integers (exact in fp16) and the key scale is folded into the queries (a block of tokens lies inside one key
group, so q . k = (q * s) . c + q . z), the outlier channels likewise, the scaled queries split into two fp16
parts where the head is small enough for the second dot's registers (PRECISE); the values are dequantized in
registers (c * s + z, rounded to fp16) and multiplied by the probabilities rounded to fp16. The exact part (sinks,
fetched set, residual window) multiplies in the exact buffers' own type."""
import triton
import triton.language as tl


@triton.jit
def _capped(s, scaling, softcap, SOFTCAP: tl.constexpr):
    """Scaled scores, softcapped as the model caps them (tanh(s / c) * c, tanh from a sigmoid)."""
    s = s * scaling
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return s


@triton.jit
def _codes_dot(qs, code, PRECISE: tl.constexpr):
    """qs [MP, N] fp32 times small-integer codes [N, BLOCK] on fp16 tensor cores -> fp32; PRECISE: qs split into
    its fp16 part and the fp16 of the rest, two dots (the codes are exact in fp16: nearly fp32's products)."""
    hi = qs.to(tl.float16)
    c = tl.trans(code.to(tl.float16))
    out = tl.dot(hi, c)
    if PRECISE:
        out += tl.dot((qs - hi.to(tl.float32)).to(tl.float16), c)
    return out


@triton.jit
def _key_scores(q, kc, ks, kz, n0, d, dm, D, G: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISE: tl.constexpr):
    """q [MP, BLOCK_D] fp32 against the quantized keys of tokens [n0, n0 + BLOCK_N) (inside one group) of
    one head (kc, ks, kz: the head's codes, scale, zero) -> raw scores [MP, BLOCK_N] fp32."""
    R: tl.constexpr = G // 8
    tt = n0 % G + tl.arange(0, BLOCK_N)
    j = n0 // G
    base = kc + j * (BITS * R * D)
    code = tl.zeros((BLOCK_N, q.shape[1]), dtype=tl.int32)
    for p in tl.static_range(BITS):
        byte = tl.load(base + p * R * D + (tt % R)[:, None] * D + d[None, :], mask=dm[None, :], other=0)
        code += ((byte.to(tl.int32) >> (tt // R)[:, None]) & 1) << p
    s = tl.load(ks + j * D + d, mask=dm, other=0).to(tl.float32)
    z = tl.load(kz + j * D + d, mask=dm, other=0).to(tl.float32)
    return _codes_dot(q * s[None, :], code, PRECISE) + tl.sum(q * z[None, :], 1)[:, None]


@triton.jit
def _outlier_scores(qo, oc, os_, oz, n0, O, G: tl.constexpr, OP: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISE: tl.constexpr):
    """qo [MP, OP] (the queries at the outlier channels) against their 4-bit keys of tokens [n0, n0 + BLOCK_N)
    (oc: the head's codes, two channels a byte; os_, oz: scale and zero per group) -> [MP, BLOCK_N] fp32."""
    o = tl.arange(0, OP)
    om = o < O
    tok = n0 + tl.arange(0, BLOCK_N)
    byte = tl.load(oc + tok[:, None] * ((O + 1) // 2) + (o // 2)[None, :], mask=om[None, :], other=0)
    code = (byte.to(tl.int32) >> ((o % 2) * 4)[None, :]) & 15
    j = n0 // G
    s = tl.load(os_ + j * O + o, mask=om, other=0).to(tl.float32)
    z = tl.load(oz + j * O + o, mask=om, other=0).to(tl.float32)
    return _codes_dot(qo * s[None, :], code, PRECISE) + tl.sum(qo * z[None, :], 1)[:, None]


@triton.jit
def _values(vc, vs, vz, n0, d, dm, D, GV: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """The quantized values of tokens [n0, n0 + BLOCK_N) of one head, dequantized -> [BLOCK_N, BLOCK_D] fp16
    (blocks of 64 tokens, byte row r, bit i -> token i*8 + r; scale and zero per token and GV channels)."""
    tok = n0 + tl.arange(0, BLOCK_N)
    blk, tt = tok // 64, tok % 64
    code = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.int32)
    for p in tl.static_range(BITS):
        byte = tl.load(vc + blk[:, None] * (BITS * 8 * D) + p * 8 * D + (tt % 8)[:, None] * D + d[None, :],
                       mask=dm[None, :], other=0)
        code += ((byte.to(tl.int32) >> (tt // 8)[:, None]) & 1) << p
    sz = tok[:, None] * (D // GV) + (d // GV)[None, :]
    s = tl.load(vs + sz, mask=dm[None, :], other=0).to(tl.float32)
    z = tl.load(vz + sz, mask=dm[None, :], other=0).to(tl.float32)
    return (code.to(tl.float32) * s + z).to(tl.float16)


@triton.jit
def _guide_scores(q, qo, kc, ks, kz, oc, os_, oz, n0, d, dm, D, O, scaling, softcap, G: tl.constexpr,
                  BITS: tl.constexpr, BLOCK_N: tl.constexpr, OP: tl.constexpr, HAS_OUT: tl.constexpr,
                  SOFTCAP: tl.constexpr, PRECISE: tl.constexpr):
    """Scaled (and capped) guide scores of a block: the main guide plus the outlier channels."""
    sc = _key_scores(q, kc, ks, kz, n0, d, dm, D, G, BITS, BLOCK_N, PRECISE)
    if HAS_OUT:
        sc += _outlier_scores(qo, oc, os_, oz, n0, O, G, OP, BLOCK_N, PRECISE)
    return _capped(sc, scaling, softcap, SOFTCAP)


@triton.jit
def _queries(q_ptr, rows, d, M, D, oi, O, OP: tl.constexpr):
    """The program's queries [MP, BLOCK_D] fp32 (q_ptr: the head's, rows of D) and, at the outlier
    channels oi (O of them, padded to OP), [MP, OP]."""
    rm = rows < M
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=rm[:, None] & (d < D)[None, :], other=0)
    o = tl.arange(0, OP)
    ch = tl.load(oi + o, mask=o < O, other=0)
    return q.to(tl.float32), ch


@triton.jit
def _rotated(q_ptr, r_ptr, rows, d, M, D, RC: tl.constexpr):
    """The head's queries (q_ptr, rows of D) times the guide's rotation R [D, D] fp32 -> [MP, BLOCK_D] fp32: RC
    channels of the queries (RC rows of R) a dot, in fp32."""
    c = tl.arange(0, RC)
    out = tl.zeros((rows.shape[0], d.shape[0]), tl.float32)
    for c0 in range(0, D, RC):
        qc = tl.load(q_ptr + rows[:, None] * D + (c0 + c)[None, :], mask=(rows < M)[:, None] & (c0 + c < D)[None, :],
                     other=0).to(tl.float32)
        rc = tl.load(r_ptr + (c0 + c)[:, None] * D + d[None, :], mask=(c0 + c < D)[:, None] & (d < D)[None, :],
                     other=0)
        out += tl.dot(qc, rc, input_precision="ieee")
    return out


@triton.jit
def _head_queries(q_ptr, r_ptr, q_sb, q_sh, oi, oi_sb, oi_sh, b, h, rows, d, M, D, O, OP: tl.constexpr,
                  ROT: tl.constexpr, RC: tl.constexpr):
    """A split program's queries of row b and KV head h: rotated by R (r_ptr; ROT) [MP, BLOCK_D], the outlier
    channels, and the unrotated queries at those channels [MP, OP]."""
    head = q_ptr + b * q_sb + h * q_sh
    q, ch = _queries(head, rows, d, M, D, oi + b * oi_sb + h * oi_sh, O, OP)
    if ROT:
        q = _rotated(head, r_ptr, rows, d, M, D, RC)
    qo = tl.load(head + rows[:, None] * D + ch[None, :],
                 mask=(rows < M)[:, None] & (tl.arange(0, OP) < O)[None, :], other=0).to(tl.float32)
    return q, ch, qo


@triton.jit
def _fetched_map(fm, fi, fok, lo, hi, K, BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """fm[n] (int8, the head's map) for n in [lo, hi): 1 at the valid fetched positions (fi, fok: the head's K
    of them), 0 elsewhere. A split program writes and reads its own range only (a barrier between)."""
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tl.store(fm + tok, tl.zeros((BLOCK_N,), tl.int8), mask=tok < hi)
    tl.debug_barrier()
    for j0 in range(0, K, KB):
        j = j0 + tl.arange(0, KB)
        idx = tl.load(fi + j, mask=j < K, other=-1).to(tl.int32)
        got = tl.load(fok + j, mask=j < K, other=0)
        tl.store(fm + idx, tl.full((KB,), 1, tl.int8), mask=(got != 0) & (idx >= lo) & (idx < hi))
    tl.debug_barrier()


@triton.jit
def _block(q, qo, kc, ks, kz, oc, os_, oz, fm, n0, hi, d, dm, D, O, scaling, softcap, G: tl.constexpr,
           BITS: tl.constexpr, BLOCK_N: tl.constexpr, OP: tl.constexpr, HAS_OUT: tl.constexpr, SOFTCAP: tl.constexpr,
           PRECISE: tl.constexpr):
    """One block of a split's positions from n0 (the pointers at the program's row and KV head): (the positions,
    their guide scores [MP, BLOCK_N], whether each is fetched: fm, 1 past hi)."""
    tok = n0 + tl.arange(0, BLOCK_N)
    s = _guide_scores(q, qo, kc, ks, kz, oc, os_, oz, n0, d, dm, D, O, scaling, softcap, G, BITS, BLOCK_N, OP, HAS_OUT,
                      SOFTCAP, PRECISE)
    held = tl.load(fm + tok, mask=tok < hi, other=1)
    return tok, s, held


@triton.jit
def guide_split_kernel(q_ptr, r_ptr, q_sb, q_sh, kc, kc_sb, kc_sh, ks, kz, ks_sb, ks_sh, vc, vc_sb, vc_sh, vs,
                       vz, vs_sb, vs_sh, oi, oi_sb, oi_sh, oc, oc_sb, oc_sh, os_, oz, os_sb, os_sh, fm, fm_sb,
                       fm_sh, fi, fok, fi_sb, fi_sh, qend_ptr, ml_ptr, acc_ptr, H, M, D, S, O, K, SPLIT, scaling,
                       softcap, G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, MP: tl.constexpr, OP: tl.constexpr, HAS_OUT: tl.constexpr,
                       SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROT: tl.constexpr, RC: tl.constexpr,
                       KB: tl.constexpr):
    """One (row, KV head, split) of the guide region: flash-decoding statistics (max, sum) and the value
    accumulator over the split's guide-only positions (neither a sink nor fetched, below the row's qend); the
    map of fetched positions of its range written first (select_weights_kernel reads it)."""
    bh, sp = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, d = tl.arange(0, MP), tl.arange(0, BLOCK_D)
    dm = d < D
    q, ch, qo = _head_queries(q_ptr, r_ptr, q_sb, q_sh, oi, oi_sb, oi_sh, b, h, rows, d, M, D, O, OP, ROT, RC)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, tl.load(qend_ptr + b).to(tl.int32))
    _fetched_map(fm + b * fm_sb + h * fm_sh, fi + b * fi_sb + h * fi_sh, fok + b * fi_sb + h * fi_sh, lo, hi, K,
                 BLOCK_N, KB)
    m_i = tl.full((MP,), float("-inf"), tl.float32)
    l_i = tl.zeros((MP,), tl.float32)
    acc = tl.zeros((MP, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        tok, s, held = _block(q, qo, kc + b * kc_sb + h * kc_sh, ks + b * ks_sb + h * ks_sh, kz + b * ks_sb + h * ks_sh,
                              oc + b * oc_sb + h * oc_sh, os_ + b * os_sb + h * os_sh, oz + b * os_sb + h * os_sh,
                              fm + b * fm_sb + h * fm_sh, n0, hi, d, dm, D, O, scaling, softcap, G, BITS, BLOCK_N, OP,
                              HAS_OUT, SOFTCAP, PRECISE)
        s = tl.where(((tok < hi) & (tok >= S) & (held == 0))[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _values(vc + b * vc_sb + h * vc_sh, vs + b * vs_sb + h * vs_sh, vz + b * vs_sb + h * vs_sh, n0, d, dm,
                    D, GV, BITS, BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    out = (sp * tl.num_programs(0) + bh) * MP
    tl.store(ml_ptr + 2 * out + rows, m_i)
    tl.store(ml_ptr + 2 * out + MP + rows, l_i)
    tl.store(acc_ptr + (out + rows[:, None]) * BLOCK_D + d[None, :], acc)


@triton.jit
def _exact_scores(q, kp, ok, d, dm, scaling, softcap, SOFTCAP: tl.constexpr):
    """q [MP, BLOCK_D] against exact keys at kp [BLOCK_E, BLOCK_D] (pointers); ok [MP, BLOCK_E]: the
    (query, key) pairs that count -> scaled, capped scores, -inf elsewhere."""
    k = tl.load(kp, mask=tl.max(ok.to(tl.int32), 0)[:, None].to(tl.int1) & dm[None, :], other=0)
    s = _capped(tl.dot(q.to(k.dtype), tl.trans(k)), scaling, softcap, SOFTCAP)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _exact_block(q, kp, vp, ok, d, dm, m_i, l_i, acc, scaling, softcap, SOFTCAP: tl.constexpr):
    """The online softmax (m_i, l_i, acc) taking a block of exact keys and values (kp, vp pointers)."""
    s = _exact_scores(q, kp, ok, d, dm, scaling, softcap, SOFTCAP)
    v = tl.load(vp, mask=tl.max(ok.to(tl.int32), 0)[:, None].to(tl.int1) & dm[None, :], other=0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _merge_splits(ml_ptr, acc_ptr, bh, NBH, NS, rows, d, MP: tl.constexpr, BLOCK_D: tl.constexpr):
    """The guide part's (max, sum, accumulator) over the splits of one (row, KV head)."""
    m_i = tl.full((MP,), float("-inf"), tl.float32)
    l_i = tl.zeros((MP,), tl.float32)
    acc = tl.zeros((MP, BLOCK_D), tl.float32)
    for sp in range(0, NS):
        at = (sp * NBH + bh) * MP
        m_s = tl.load(ml_ptr + 2 * at + rows)
        l_s = tl.load(ml_ptr + 2 * at + MP + rows)
        a_s = tl.load(acc_ptr + (at + rows[:, None]) * BLOCK_D + d[None, :])
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp(m_i - m_safe), tl.exp(m_s - m_safe)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _unrotate(out_ptr, r_ptr, g, rows, d, M, D, RC: tl.constexpr):
    """out [M, D] (the head's output, its exact part stored) += g [MP, BLOCK_D] @ R^T, RC output channels a dot
    in fp32 (R [D, D] fp32)."""
    c = tl.arange(0, RC)
    for c0 in range(0, D, RC):
        rt = tl.load(r_ptr + (c0 + c)[None, :] * D + d[:, None], mask=(d < D)[:, None] & (c0 + c < D)[None, :],
                     other=0)
        at = rows[:, None] * D + (c0 + c)[None, :]
        ok = (rows < M)[:, None] & (c0 + c < D)[None, :]
        tl.store(out_ptr + at, tl.load(out_ptr + at, mask=ok, other=0) + tl.dot(g, rt, input_precision="ieee"),
                 mask=ok)


@triton.jit
def decode_merge_kernel(q_ptr, q_sb, q_sh, sk, sv, sk_sb, sk_sh, fk, fv, fk_sb, fk_sh, fi, fok, fi_sb, fi_sh, rk,
                        rv, rk_sb, rk_sh, qend_ptr, start_ptr, ml_ptr, acc_ptr, out_ptr, r_ptr, stat_ptr, cand,
                        cand_sb, NS, H, M, D, S, K, W, T, sel, scaling, softcap, MP: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, SOFTCAP: tl.constexpr, ROT: tl.constexpr,
                        SELECT: tl.constexpr, RC: tl.constexpr):
    """One (row, KV head): the exact part (sinks below the row's qend, the valid fetched positions below it,
    the residual window's slots j at position qend + j, causal per new token) in one online softmax, merged
    with the guide part's splits: out = exact values + guide values over the one softmax's sum (ROT: the guide
    part rotated back by R^T, _unrotate); the final (max, sum) per query kept. SELECT: the selecting queries'
    (sel: the new token, -1 both) weights of the fetched positions and the residual slots as candidate keys at
    cand[row*KV head] (K + W of them; cand_sb apart)."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    rows, d, e = tl.arange(0, MP), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_E)
    dm, rm = d < D, rows < M
    q = tl.load(q_ptr + b * q_sb + h * q_sh + rows[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :],
                other=0).to(tl.float32)
    qend = tl.load(qend_ptr + b).to(tl.int32)
    pos = tl.load(start_ptr + b).to(tl.int32) + rows % T  # each query's position
    m_e = tl.full((MP,), float("-inf"), tl.float32)
    l_e = tl.zeros((MP,), tl.float32)
    acc_e = tl.zeros((MP, BLOCK_D), tl.float32)
    for j0 in range(0, S, BLOCK_E):
        j = j0 + e
        ok = rm[:, None] & ((j < S) & (j < qend))[None, :]
        at = b * sk_sb + h * sk_sh + j[:, None] * D + d[None, :]
        m_e, l_e, acc_e = _exact_block(q, sk + at, sv + at, ok, d, dm, m_e, l_e, acc_e, scaling, softcap, SOFTCAP)
    for j0 in range(0, K, BLOCK_E):
        j = j0 + e
        idx = tl.load(fi + b * fi_sb + h * fi_sh + j, mask=j < K, other=0)
        got = tl.load(fok + b * fi_sb + h * fi_sh + j, mask=j < K, other=0)
        ok = rm[:, None] & ((j < K) & (got != 0) & (idx < qend))[None, :]
        at = b * fk_sb + h * fk_sh + j[:, None] * D + d[None, :]
        m_e, l_e, acc_e = _exact_block(q, fk + at, fv + at, ok, d, dm, m_e, l_e, acc_e, scaling, softcap, SOFTCAP)
    for j0 in range(0, W, BLOCK_E):
        j = j0 + e
        ok = rm[:, None] & (j < W)[None, :] & ((qend + j)[None, :] <= pos[:, None])
        at = b * rk_sb + h * rk_sh + j[:, None] * D + d[None, :]
        m_e, l_e, acc_e = _exact_block(q, rk + at, rv + at, ok, d, dm, m_e, l_e, acc_e, scaling, softcap, SOFTCAP)
    m_g, l_g, acc_g = _merge_splits(ml_ptr, acc_ptr, bh, tl.num_programs(0), NS, rows, d, MP, BLOCK_D)
    m = tl.maximum(m_e, m_g)
    alpha, beta = tl.exp(m_e - m), tl.exp(m_g - m)
    l_all = l_e * alpha + l_g * beta
    at = (bh * M + rows[:, None]) * D + d[None, :]
    keep = rm[:, None] & dm[None, :]
    if ROT:
        tl.store(out_ptr + at, acc_e * (alpha / l_all)[:, None], mask=keep)
        tl.debug_barrier()
        _unrotate(out_ptr + bh * M * D, r_ptr, acc_g * (beta / l_all)[:, None], rows, d, M, D, RC)
    else:
        tl.store(out_ptr + at, (acc_e * alpha[:, None] + acc_g * beta[:, None]) / l_all[:, None], mask=keep)
    tl.store(stat_ptr + 2 * bh * MP + rows, m)
    tl.store(stat_ptr + 2 * bh * MP + MP + rows, l_all)
    if SELECT:
        picks = rm & ((rows % T == sel) | (sel < 0))
        _exact_weights(q, fk + b * fk_sb + h * fk_sh, fi + b * fi_sb + h * fi_sh, fok + b * fi_sb + h * fi_sh,
                       rk + b * rk_sb + h * rk_sh, cand + bh * cand_sb, qend, pos, picks, m, l_all, d, dm, rm, D, K,
                       W, scaling, softcap, BLOCK_E, SOFTCAP)


@triton.jit
def _weights(s, sel, m, l_all):
    """The selecting queries' probabilities summed per key: s [MP, N] scores, sel [MP] which queries select,
    (m, l_all) [MP] the one softmax's max and sum -> [N]."""
    p = tl.exp(s - tl.where(sel, m, 0.0)[:, None]) / tl.where(sel, l_all, 1.0)[:, None]
    return tl.sum(tl.where(sel[:, None], p, 0.0), 0)


@triton.jit
def _keys(w, pos, ok):
    """Candidates packed into one sortable int64: a weight's fp32 bits (>= 0: ordered as integers) above its
    position; -1 where not a candidate."""
    bits = w.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(ok, (bits << 32) | pos.to(tl.int64), -1)


@triton.jit
def _exact_weights(q, fk, fi, fok, rk, out, qend, pos, picks, m, l_all, d, dm, rm, D, K, W, scaling, softcap,
                   BLOCK_E: tl.constexpr, SOFTCAP: tl.constexpr):
    """The selecting queries' weights of the fetched positions and of the residual slots (at position qend + j),
    as candidate keys (_keys) at out[j] and out[K + j]; fk, fi, fok, rk: the head's buffers."""
    e = tl.arange(0, BLOCK_E)
    for j0 in range(0, K, BLOCK_E):
        j = j0 + e
        idx = tl.load(fi + j, mask=j < K, other=0)
        got = tl.load(fok + j, mask=j < K, other=0)
        use = (j < K) & (got != 0) & (idx < qend)
        s = _exact_scores(q, fk + j[:, None] * D + d[None, :], rm[:, None] & use[None, :], d, dm, scaling, softcap,
                          SOFTCAP)
        tl.store(out + j, _keys(_weights(s, picks, m, l_all), idx, use), mask=j < K)
    for j0 in range(0, W, BLOCK_E):
        j = j0 + e
        ok = rm[:, None] & (j < W)[None, :] & ((qend + j)[None, :] <= pos[:, None])
        s = _exact_scores(q, rk + j[:, None] * D + d[None, :], ok, d, dm, scaling, softcap, SOFTCAP)
        tl.store(out + K + j, _keys(_weights(s, picks, m, l_all), qend + j, j < W), mask=j < W)


@triton.jit
def write_recent_kernel(k_ptr, v_ptr, k_sb, k_sh, k_st, k_sd, v_sb, v_sh, v_st, v_sd, start_ptr, qend_ptr, rk, rv,
                        rk_sb, rk_sh, sk, sv, sk_sb, sk_sh, H, T, D, S, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, KV head) of a pass's new keys and values k, v [b, H, T, D] (any strides): token t (position
    start + t) into the residual window's slot start + t - qend, and into the sinks where its position is below S."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    t, d = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_D)
    pos = tl.load(start_ptr + b).to(tl.int32) + t
    slot = pos - tl.load(qend_ptr + b).to(tl.int32)
    ok = (t < T)[:, None] & (d < D)[None, :]
    kk = tl.load(k_ptr + b * k_sb + h * k_sh + t[:, None] * k_st + d[None, :] * k_sd, mask=ok, other=0)
    vv = tl.load(v_ptr + b * v_sb + h * v_sh + t[:, None] * v_st + d[None, :] * v_sd, mask=ok, other=0)
    res = b * rk_sb + h * rk_sh + slot[:, None] * D + d[None, :]
    tl.store(rk + res, kk.to(rk.dtype.element_ty), mask=ok)
    tl.store(rv + res, vv.to(rv.dtype.element_ty), mask=ok)
    sink = b * sk_sb + h * sk_sh + pos[:, None] * D + d[None, :]
    tl.store(sk + sink, kk.to(sk.dtype.element_ty), mask=ok & (pos < S)[:, None])
    tl.store(sv + sink, vv.to(sv.dtype.element_ty), mask=ok & (pos < S)[:, None])
