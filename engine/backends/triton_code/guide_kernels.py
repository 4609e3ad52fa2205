"""The guide's Triton kernels (wrappers, layout and references: engine/backends/triton_guide.py). Imported
only where they run (CUDA, or Triton's interpreter in the tests): importing Triton costs ~0.25 s."""
import triton
import triton.language as tl


@triton.jit
def scores_kernel(q_ptr, q_sb, q_sh, q_sq, c_ptr, c_sb, c_sh, s_ptr, z_ptr, s_sb, s_sh, o_ptr, o_sb, o_sh, o_sq,
                  H, D, NQ, G: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr, NQP: tl.constexpr):
    bh, j = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    R: tl.constexpr = G // 8
    t = tl.arange(0, G)
    d = tl.arange(0, BLOCK_D)
    qi = tl.arange(0, NQP)
    dm, qm = d < D, qi < NQ
    base = c_ptr + b * c_sb + h * c_sh + j * (BITS * R * D)
    code = tl.zeros((G, BLOCK_D), dtype=tl.float32)
    for p in tl.static_range(BITS):
        byte = tl.load(base + p * R * D + (t % R)[:, None] * D + d[None, :], mask=dm[None, :], other=0)
        code += ((byte.to(tl.int32) >> (t // R)[:, None]) & 1).to(tl.float32) * (1 << p)
    sz = b * s_sb + h * s_sh + j * D + d
    s = tl.load(s_ptr + sz, mask=dm, other=0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=dm, other=0).to(tl.float32)
    k = code * s[None, :] + z[None, :]  # [G, D]: K of the group (0 in padded channels)
    qd = tl.load(q_ptr + b * q_sb + h * q_sh + qi[None, :] * q_sq + d[:, None], mask=dm[:, None] & qm[None, :],
                 other=0).to(tl.float32)  # [D, NQP]
    sc = tl.dot(k, qd, input_precision="ieee")  # [G, NQP]
    tl.store(o_ptr + b * o_sb + h * o_sh + qi[None, :] * o_sq + (j * G + t)[:, None], sc, mask=qm[None, :])

@triton.jit
def values_kernel(p_ptr, p_sb, p_sh, p_sq, c_ptr, c_sb, c_sh, s_ptr, z_ptr, s_sb, s_sh, o_ptr,
                  H, D, NQ, n, NB, BPS, GV: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr,
                  NQP: tl.constexpr):
    bh, sp = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t = tl.arange(0, 64)
    d = tl.arange(0, BLOCK_D)
    qi = tl.arange(0, NQP)
    dm, qm = d < D, qi < NQ
    acc = tl.zeros((NQP, BLOCK_D), dtype=tl.float32)
    for blk in range(sp * BPS, tl.minimum(NB, (sp + 1) * BPS)):
        tok = blk * 64 + t
        tm = tok < n
        m2 = tm[:, None] & dm[None, :]
        base = c_ptr + b * c_sb + h * c_sh + blk * (BITS * 8 * D)
        code = tl.zeros((64, BLOCK_D), dtype=tl.float32)
        for p in tl.static_range(BITS):
            byte = tl.load(base + p * 8 * D + (t % 8)[:, None] * D + d[None, :], mask=m2, other=0)
            code += ((byte.to(tl.int32) >> (t // 8)[:, None]) & 1).to(tl.float32) * (1 << p)
        sz = b * s_sb + h * s_sh + tok[:, None] * (D // GV) + (d // GV)[None, :]
        s = tl.load(s_ptr + sz, mask=m2, other=0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=m2, other=0).to(tl.float32)
        v = code * s + z  # [64, D]: V of the block (0 past n and in padded channels)
        pv = tl.load(p_ptr + b * p_sb + h * p_sh + qi[:, None] * p_sq + tok[None, :], mask=qm[:, None] & tm[None, :],
                     other=0).to(tl.float32)  # [NQP, 64]
        acc += tl.dot(pv, v, input_precision="ieee")
    out = o_ptr + ((sp * (tl.num_programs(0)) + bh) * NQ + qi[:, None]) * D + d[None, :]
    tl.store(out, acc, mask=qm[:, None] & dm[None, :])


@triton.jit
def gather_kernel(sk_ptr, sv_ptr, s_sb, s_sh, s_sl, idx_ptr, i_sb, i_sh, m_ptr, m_sb, m_sh, dk_ptr, dv_ptr, d_sb,
                  d_sh, d_sk, H, K, D, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    bh, kb = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    j = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    jm, dm = j < K, d < D
    if MASKED:  # only the slots asked for (the rest of dst kept)
        jm = jm & (tl.load(m_ptr + b * m_sb + h * m_sh + j, mask=jm, other=0) != 0)
    m2 = jm[:, None] & dm[None, :]
    pos = tl.load(idx_ptr + b * i_sb + h * i_sh + j, mask=jm, other=0)
    src = b * s_sb + h * s_sh + pos[:, None] * s_sl + d[None, :]
    dst = b * d_sb + h * d_sh + j[:, None] * d_sk + d[None, :]
    tl.store(dk_ptr + dst, tl.load(sk_ptr + src, mask=m2), mask=m2)
    tl.store(dv_ptr + dst, tl.load(sv_ptr + src, mask=m2), mask=m2)
