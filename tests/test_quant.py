"""engine.kvcache.quant: packing, KIVI 1/2-bit quantizers, packed-code kernels (native and torch),
storage accounting."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from engine import native
from engine.backends.kernels import backend_for
from engine.kvcache import quant
from engine.kvcache.rotation import hadamard, rotation_matrix
from engine.kvcache.quant import (
    VALUE_BLOCK,
    dequantize_keys,
    dequantize_values,
    empty_keys,
    empty_values,
    guide_bits_per_element,
    guide_scores,
    guide_scores_reference,
    guide_weighted_values,
    guide_weighted_values_reference,
    pack_codes,
    quantize_keys,
    quantize_keys_into,
    quantize_values,
    quantize_values_into,
    tensor_bytes,
    unpack_codes,
)

BITS = [1, 2]
GROUPS = [32, 64]
FP16_EPS = 2.0**-10  # fp16 rounding (2**-11 relative) of scale and zero, with margin


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread. With 2 threads on a busy 2-core machine, OpenMP waits
    made this file 40x slower (13 s instead of 0.3 s)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kv_like(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random data with per-channel offsets and a few outliers, like real keys."""
    g = gen(seed)
    x = torch.randn(*shape, generator=g)
    x += 3 * torch.randn(shape[-1], generator=g)  # channel offsets
    x.view(-1)[:: 97] *= 8  # outliers
    return x


# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(8,), (3, 16), (5, 7, 24), (2, 3, 1, 64), (1, 136)])
def test_pack_unpack_round_trip(bits, shape):
    codes = torch.randint(0, 1 << bits, shape, generator=gen(sum(shape)), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], shape[-1] * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    assert torch.equal(unpack_codes(packed, bits, shape[-1] - 3), codes[..., :-3])


def test_pack_layout_is_bit_sliced():
    # 1 bit, N = 32 -> R = 4 bytes; code t = i*R + r sits in byte r, bit i
    codes = torch.zeros(32, dtype=torch.uint8)
    codes[2 * 4 + 1] = 1  # i = 2, r = 1
    assert pack_codes(codes, 1).tolist() == [0, 1 << 2, 0, 0]
    # 2 bit: low plane bytes first, then high plane bytes
    codes = torch.zeros(16, dtype=torch.uint8)  # R = 2
    codes[3 * 2 + 0] = 2  # i = 3, r = 0, high bit only
    codes[5 * 2 + 1] = 3  # i = 5, r = 1, both bits
    assert pack_codes(codes, 2).tolist() == [0, 1 << 5, 1 << 3, 1 << 5]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(12, dtype=torch.uint8), 1)
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(8, dtype=torch.uint8), 3)


# ------------------------------------------------------------------------ quantization


def _recon_levels(lo, hi, bits):
    """Reconstruction levels per group from the exact min/max (before fp16 rounding)."""
    rng = hi - lo
    if bits == 2:
        return [lo + m * rng / 3 for m in range(4)]
    return [lo + rng / 4, lo + 3 * rng / 4]


def _check_error(x, xr, lo, hi, bits):
    """x, xr [..., g] with group min/max lo, hi [...]: the per-element error bound."""
    rng = (hi - lo)[..., None]
    bound = rng / 6 if bits == 2 else rng / 4  # half a step: s/2 = range/6; 1 bit: range/4
    slack = FP16_EPS * (rng + torch.maximum(lo.abs(), hi.abs())[..., None]) + 1e-6
    err = (x - xr).abs()
    assert torch.all(err <= bound + slack), (err - bound).max()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_keys_error_bound(bits, group):
    k = kv_like(2, 3, 4 * group, 64, seed=bits + group)
    qk = quantize_keys(k, bits, group)
    assert qk.codes.shape == (2, 3, 4, bits, group // 8, 64)
    assert qk.scale.shape == qk.zero.shape == (2, 3, 4, 64)
    assert qk.scale.dtype == qk.zero.dtype == torch.float16
    kr = dequantize_keys(qk)
    assert kr.shape == k.shape and kr.dtype == torch.float32
    x = k.view(2, 3, 4, group, 64).transpose(-1, -2)  # [B, H, J, D, g]: per-channel groups
    xr = kr.view(2, 3, 4, group, 64).transpose(-1, -2)
    _check_error(x, xr, x.amin(-1), x.amax(-1), bits)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_values_error_bound(bits, group):
    v = kv_like(2, 3, 70, 64, seed=10 + bits + group)
    qv = quantize_values(v, bits, group)
    assert qv.scale.shape == qv.zero.shape == (2, 3, 70, 64 // group)
    vr = dequantize_values(qv)
    assert vr.shape == v.shape
    x = v.view(2, 3, 70, 64 // group, group)  # per-token groups of channels
    xr = vr.view(2, 3, 70, 64 // group, group)
    _check_error(x, xr, x.amin(-1), x.amax(-1), bits)


@pytest.mark.parametrize("bits", BITS)
def test_codes_are_nearest_level_for_stored_params(bits):
    """The code is clamp(round((x - z) / s)) with the stored fp16 s, z, and x' = c s + z."""
    k = kv_like(1, 2, 64, 16, seed=3)
    qk = quantize_keys(k, bits, 32)
    s = qk.scale.float().repeat_interleave(32, dim=2)  # [B, H, L, D]
    z = qk.zero.float().repeat_interleave(32, dim=2)
    c = torch.round((k - z) / s).clamp(0, (1 << bits) - 1)
    torch.testing.assert_close(dequantize_keys(qk), c * s + z, rtol=0, atol=1e-6)


def test_one_bit_levels_and_clamp_at_max():
    # one key group of 32 tokens x 1 channel: min 0, max 8 -> levels 2 and 6
    x = torch.linspace(0.0, 8.0, 32).view(1, 1, 32, 1).repeat(1, 1, 1, 8)
    qk = quantize_keys(x, 1, 32)
    assert torch.all(qk.zero.float() == 2.0) and torch.all(qk.scale.float() == 4.0)
    codes = unpack_codes(qk.codes.view(1, 1, 1, 4, 8).permute(0, 1, 2, 4, 3).reshape(1, 1, 8, 4), 1)
    assert codes[..., -1].eq(1).all()  # x = max: raw code 1.5 is clamped to 1
    assert codes[..., 0].eq(0).all()  # x = min: raw code -0.5 is clamped to 0
    xr = dequantize_keys(qk)
    assert torch.all(xr[:, :, -1] == 6.0)  # min + 3 * range / 4
    assert torch.all(xr[:, :, 0] == 2.0)  # min + range / 4
    assert set(xr.unique().tolist()) == {2.0, 6.0}
    # values: one token, 64 channels 0..8
    v = torch.linspace(0.0, 8.0, 64).view(1, 1, 1, 64)
    vr = dequantize_values(quantize_values(v, 1, 64))
    assert vr[0, 0, 0, -1] == 6.0 and vr[0, 0, 0, 0] == 2.0


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("const", [0.0, 0.75, -3.5, 1024.0])
def test_constant_groups_reconstruct_exactly(bits, const):
    k = kv_like(1, 2, 64, 16, seed=4)
    k[:, :, :32, 5] = const  # one constant key group (channel 5, tokens 0..31)
    k[:, 1] = const  # a whole constant head
    qk = quantize_keys(k, bits, 32)
    kr = dequantize_keys(qk)
    assert not torch.isnan(kr).any()
    assert torch.all(kr[:, :, :32, 5] == const) and torch.all(kr[:, 1] == const)
    v = kv_like(1, 2, 5, 64, seed=5)
    v[:, :, 2] = const  # constant tokens
    v[:, 0, 3, :32] = const  # one constant channel group
    vr = dequantize_values(quantize_values(v, bits, 32))
    assert not torch.isnan(vr).any()
    assert torch.all(vr[:, :, 2] == const) and torch.all(vr[:, 0, 3, :32] == const)
    q = torch.randn(1, 2, 3, 16, generator=gen(6))
    assert not torch.isnan(guide_scores(q, qk, 64)).any()


def test_all_zero_input():
    for bits in BITS:
        z = torch.zeros(1, 1, 64, 64)
        assert torch.equal(dequantize_keys(quantize_keys(z, bits, 64)), z)
        assert torch.equal(dequantize_values(quantize_values(z, bits, 64)), z)


# ---------------------------------------------------------------------------- storage


@pytest.mark.parametrize(
    "bits,group,bpe", [(1, 64, 1.5), (1, 32, 2.0), (2, 64, 2.5), (2, 32, 3.0)]
)
def test_storage_matches_formula(bits, group, bpe):
    assert guide_bits_per_element(bits, group) == bpe
    b, h, n, d = 2, 3, 256, 64
    elements = b * h * n * d
    x = torch.randn(b, h, n, d, generator=gen(7))
    for q in (quantize_keys(x, bits, group), quantize_values(x, bits, group)):
        assert tensor_bytes(q) * 8 == elements * bpe
        assert tensor_bytes(q) / (elements * 2) == bpe / 16  # vs fp16; 1-bit g64: 0.09375
        assert tensor_bytes(q) == tensor_bytes(
            (empty_keys if isinstance(q, quant.QuantizedKeys) else empty_values)(b, h, n, d, bits, group)
        )


# ---------------------------------------------------------------------------- kernels


def _close(a, b, rel=1e-5):
    torch.testing.assert_close(a, b, rtol=rel, atol=rel * b.abs().max().item() + 1e-6)


needs_native = pytest.mark.skipif(
    not native.native_available(),
    reason=f"native guide kernels unavailable ({native.native_error() or 'disabled by SPECACHE_NATIVE'})")


@pytest.fixture
def native_only(monkeypatch):
    """Fail instead of silently taking the torch path (the native kernels must handle the case)."""
    def boom(*args, **kwargs):
        raise AssertionError("the torch kernel ran instead of the native one")
    monkeypatch.setattr(quant, "_torch_scores", boom)
    monkeypatch.setattr(quant, "_torch_weighted_values", boom)


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    """Run a kernel test through the native kernels (skipped when unavailable) or the torch path."""
    if request.param == "native":
        if not native.native_available():
            pytest.skip(f"native guide kernels unavailable ({native.native_error() or 'disabled'})")
        request.getfixturevalue("native_only")
    else:
        monkeypatch.setenv(native.ENV_DISABLE, "0")
    return request.param


@pytest.mark.kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_guide_scores_match_reference(bits, group, backend):
    b, h, nq, d = 2, 3, 5, 64
    k = kv_like(b, h, 4 * group, d, seed=20 + bits + group)
    qk = empty_keys(b, h, 6 * group, d, bits, group)  # capacity beyond the filled part
    quantize_keys_into(qk, k, 0)
    q = torch.randn(b, h, nq, d, generator=gen(21))
    for n in (group, 3 * group, 4 * group):
        ref = guide_scores_reference(q, qk, n)
        out = guide_scores(q, qk, n)
        assert out.shape == (b, h, nq, n) and out.dtype == torch.float32
        _close(out, ref)
        # the reference itself equals q @ dequantized K
        _close(ref, q @ dequantize_keys(qk, n).transpose(-1, -2))
        bf = guide_scores(q, qk, n, dtype=torch.bfloat16)
        assert (bf - ref).abs().max() <= 0.02 * ref.abs().max()
    assert guide_scores(q, qk, 0).shape == (b, h, nq, 0)
    with pytest.raises(ValueError):
        guide_scores(q, qk, group + 8)  # keys come in whole groups


@pytest.mark.kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_guide_weighted_values_match_reference(bits, group, backend):
    b, h, nq, d = 2, 3, 5, 64
    cap = 3 * VALUE_BLOCK + 10
    v = kv_like(b, h, cap, d, seed=30 + bits + group)
    qv = empty_values(b, h, cap, d, bits, group)
    quantize_values_into(qv, v, 0)
    for n in (1, 7, 63, 64, 65, 130, cap):
        p = torch.softmax(torch.randn(b, h, nq, n, generator=gen(n)), -1)
        ref = guide_weighted_values_reference(p, qv, n)
        out = guide_weighted_values(p, qv, n)
        assert out.shape == (b, h, nq, d) and out.dtype == torch.float32
        _close(out, ref)
        _close(ref, p @ dequantize_values(qv, n))
        bf = guide_weighted_values(p, qv, n, dtype=torch.bfloat16)
        assert (bf - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.kernels
@pytest.mark.parametrize("bits", BITS)
def test_kernels_on_row_views_and_small_chunks(bits, monkeypatch, backend):
    """Batch-row views (as the engine slices them) and many chunks give the same results."""
    b, h, nq, d, g = 3, 2, 6, 64, 32
    k = kv_like(b, h, 8 * g, d, seed=40)
    v = kv_like(b, h, 5 * VALUE_BLOCK - 3, d, seed=41)
    qk, qv = quantize_keys(k, bits, g), quantize_values(v, bits, 32)
    q = torch.randn(2, h, nq, d, generator=gen(42))
    p = torch.softmax(torch.randn(2, h, nq, v.shape[2], generator=gen(43)), -1)
    rows = slice(1, 3)
    qk_r = replace(qk, codes=qk.codes[rows], scale=qk.scale[rows], zero=qk.zero[rows])
    qv_r = replace(qv, codes=qv.codes[rows], scale=qv.scale[rows], zero=qv.zero[rows])
    s_ref = guide_scores_reference(q, qk_r, 7 * g)
    v_ref = guide_weighted_values_reference(p, qv_r, v.shape[2])
    _close(guide_scores(q, qk_r, 7 * g), s_ref)
    _close(guide_weighted_values(p, qv_r, v.shape[2]), v_ref)
    monkeypatch.setattr(quant, "_CHUNK_BYTES", 20_000)  # a few groups / blocks per chunk
    _close(guide_scores(q, qk_r, 7 * g), s_ref)
    _close(guide_weighted_values(p, qv_r, v.shape[2]), v_ref)


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("batch,nq", [(1, 3), (2, 1), (1, 4), (3, 6), (2, 11)])
def test_native_matches_torch(bits, group, batch, nq, monkeypatch):
    """Native kernels == torch reference within 1e-4 relative, for several lengths; Q <= 4 takes
    the few-query (permute) kernels where the CPU has them, Q > 8 two query blocks; values
    lengths not a multiple of 64 end in a partial block."""
    h, d = 3, 64
    cap = 6 * VALUE_BLOCK
    k = kv_like(batch, h, cap, d, seed=70 + bits + group)
    v = kv_like(batch, h, cap, d, seed=71 + bits + group)
    qk = empty_keys(batch, h, cap, d, bits, group)
    quantize_keys_into(qk, k, 0)
    qv = empty_values(batch, h, cap, d, bits, group)
    quantize_values_into(qv, v, 0)
    q = torch.randn(batch, h, nq, d, generator=gen(72))
    for n in (group, 3 * group, cap - group, cap):
        s = guide_scores(q, qk, n)
        assert s.shape == (batch, h, nq, n) and s.dtype == torch.float32
        _close(s, guide_scores_reference(q, qk, n), rel=1e-4)
        assert torch.equal(s, backend_for("cpu").guide_scores(q, qk, n))  # it was the native kernel
        monkeypatch.setenv(native.ENV_DISABLE, "0")
        _close(s, guide_scores(q, qk, n), rel=1e-4)  # the torch kernel
        monkeypatch.delenv(native.ENV_DISABLE)
    for n in (1, 5, 63, 64, 65, 127, 200, cap - 1, cap):
        p = torch.softmax(torch.randn(batch, h, nq, n, generator=gen(n)), -1)
        o = guide_weighted_values(p, qv, n)
        assert o.shape == (batch, h, nq, d) and o.dtype == torch.float32
        _close(o, guide_weighted_values_reference(p, qv, n), rel=1e-4)
        assert torch.equal(o, backend_for("cpu").guide_values(p, qv, n))
        monkeypatch.setenv(native.ENV_DISABLE, "0")
        _close(o, guide_weighted_values(p, qv, n), rel=1e-4)
        monkeypatch.delenv(native.ENV_DISABLE)


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("nq", [3, 6])
def test_native_other_head_dims(bits, head_dim, nq, native_only):
    """Rows of several 64-bit words and a partial last word (head_dim % 64 != 0), with few
    (Q <= 4) and more queries."""
    b, h, g = 2, 2, 32
    k = kv_like(b, h, 4 * g, head_dim, seed=head_dim)
    v = kv_like(b, h, 3 * g + 3, head_dim, seed=head_dim + 1)
    qk, qv = quantize_keys(k, bits, g), quantize_values(v, bits, g)
    q = torch.randn(b, h, nq, head_dim, generator=gen(75))
    p = torch.softmax(torch.randn(b, h, nq, v.shape[2], generator=gen(76)), -1)
    _close(guide_scores(q, qk, 4 * g), guide_scores_reference(q, qk, 4 * g), rel=1e-4)
    _close(guide_weighted_values(p, qv, v.shape[2]), guide_weighted_values_reference(p, qv, v.shape[2]), rel=1e-4)


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_threads_and_strided_inputs(threads, monkeypatch, native_only):
    """Thread counts split the work differently (groups / blocks per item): same results; the
    engine's inputs are views (a [..., :n] slice of a wider probability row, a batch-row slice
    of the guide, a non-contiguous query)."""
    monkeypatch.setenv(native.ENV_THREADS, str(threads))
    b, h, nq, d, g = 3, 2, 6, 128, 32
    k = kv_like(b, h, 9 * g, d, seed=80)
    v = kv_like(b, h, 9 * g - 5, d, seed=81)
    qk, qv = quantize_keys(k, 2, g), quantize_values(v, 1, g)
    rows = slice(1, 3)
    qk_r = replace(qk, codes=qk.codes[rows], scale=qk.scale[rows], zero=qk.zero[rows])
    qv_r = replace(qv, codes=qv.codes[rows], scale=qv.scale[rows], zero=qv.zero[rows])
    q = torch.randn(2, nq, h, d, generator=gen(82)).transpose(1, 2)  # [2, H, Q, D], strided
    n = v.shape[2]
    p_wide = torch.softmax(torch.randn(2, h, nq, n + 1, generator=gen(83)), -1)
    p = p_wide[..., :n]  # row stride n + 1, as the engine slices its probabilities
    _close(guide_scores(q, qk_r, 8 * g), guide_scores_reference(q, qk_r, 8 * g), rel=1e-4)
    _close(guide_weighted_values(p, qv_r, n), guide_weighted_values_reference(p, qv_r, n), rel=1e-4)
    q16 = q.to(torch.bfloat16)  # other input dtypes are converted
    _close(guide_scores(q16, qk_r, 8 * g), guide_scores_reference(q16.float(), qk_r, 8 * g), rel=1e-4)


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("nq", [3, 6])
def test_native_ignores_garbage_past_n(nq, native_only):
    """Value tokens past n (same block, never written, or NaN scales) do not leak into the result."""
    b, h, d = 1, 2, 64
    v = kv_like(b, h, 100, d, seed=90)
    qv = quantize_values(v, 2, 64)
    qv.codes[:, :, 1].fill_(255)  # block 1: tokens 64..99 all code 3
    qv.scale[:, :, 70:] = float("nan")
    qv.zero[:, :, 70:] = float("inf")
    p = torch.softmax(torch.randn(b, h, nq, 70, generator=gen(91)), -1)
    out = guide_weighted_values(p, qv, 70)
    assert torch.isfinite(out).all()
    _close(out, guide_weighted_values_reference(p, qv, 70), rel=1e-4)


def test_native_disabled_by_env(monkeypatch):
    """Read once, at the first use in a process (lib() is on every decode step's path)."""
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv(native.ENV_DISABLE, "0")
    assert not native.native_available()
    assert native.lib() is None
    monkeypatch.delenv(native.ENV_DISABLE)
    assert native.lib() is None  # decided for this process


def test_fallback_when_native_unavailable(monkeypatch, tmp_path, caplog):
    """A failed build (here: no compiler) silently falls back to torch, logged once at debug level."""
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.delenv("SPECACHE_NATIVE", raising=False)  # a build is tried even in a torch-only run
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        assert not native.native_available()
        assert not native.native_available()  # tried once, not again
    assert native.native_error()
    assert len([r for r in caplog.records if r.name == native.__name__]) == 1
    k = kv_like(2, 3, 128, 64, seed=95)
    v = kv_like(2, 3, 100, 64, seed=96)
    qk, qv = quantize_keys(k, 2, 64), quantize_values(v, 2, 64)
    q = torch.randn(2, 3, 6, 64, generator=gen(97))
    p = torch.softmax(torch.randn(2, 3, 6, 100, generator=gen(98)), -1)
    _close(guide_scores(q, qk, 128), guide_scores_reference(q, qk, 128))
    _close(guide_weighted_values(p, qv, 100), guide_weighted_values_reference(p, qv, 100))


@needs_native
def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    """build() compiles into the cache dir once (a second call runs no compiler), leaves no temporary file, and
    the name depends on the source, compiler and machine. The compiler is a stand-in that logs its calls and
    copies the library this process already built for real (every kernel test compiles and loads that one);
    a real compile here took ~30 s of the suite for the same checks."""
    real = native.build()
    cc, log = tmp_path / "cc", tmp_path / "compiles"
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo fake-cc 1.0; exit 0; }}\n'
                  f'case " $* " in *" -c "*) ;; *) echo link >> "{log}";; esac\n'  # one link per build
                  f'prev=; for a; do [ "$prev" = -o ] && cp "{real}" "$a"; prev=$a; done\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = native.build()
    assert path.parent == tmp_path / "cache" / "native" and path.name.startswith("guide-") and path.suffix == ".so"
    assert path.name != real.name  # another compiler, another name
    mtime = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == mtime  # cached
    assert log.read_text().count("link") == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files or objects left
    native._load(path)


def test_build_falls_back_without_openmp_and_says_why_it_failed(monkeypatch, tmp_path):
    """A compiler that rejects -fopenmp for one source (the objects are compiled side by side): the build
    takes the variant without OpenMP; one that rejects everything: a RuntimeError with each variant's exit
    and message, and nothing left in the cache folder."""
    real = native.build()
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake-cc 2.0; exit 0; }\n'
                  'case " $* " in *" -fopenmp "*guide_kernels.c*) echo "no omp.h" >&2; exit 3;; esac\n'
                  f'[ -e "{tmp_path}/broken" ] && {{ echo "cannot compile" >&2; exit 4; }}\n'
                  f'case " $* " in *" -c "*) ;; *) echo "$*" >> "{tmp_path}/links";; esac\n'
                  f'prev=; for a; do [ "$prev" = -o ] && cp "{real}" "$a"; prev=$a; done\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = native.build()
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    links = (tmp_path / "links").read_text().splitlines()
    assert len(links) == 1 and "-fopenmp" not in links[0]  # the OpenMP variant failed before its link
    native._load(path)
    (tmp_path / "broken").touch()
    with pytest.raises(RuntimeError) as info:
        native.build(force=True, march="x86-64-v2")
    lines = str(info.value).splitlines()[1:]  # a line per variant: with OpenMP, without
    assert len(lines) == 2 and all(line.endswith("exit 4: cannot compile") for line in lines)
    assert " -fopenmp " in lines[0] and "-fopenmp" not in lines[1]
    assert [p.name for p in path.parent.iterdir()] == [path.name]


# ---------------------------------------------------------------------- incremental fill


def _assert_same(a, b):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scale, b.scale)
    assert torch.equal(a.zero, b.zero)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_keys_into_equals_one_shot(bits, group):
    b, h, d = 2, 3, 64
    k = kv_like(b, h, 5 * group, d, seed=50)
    dst = empty_keys(b, h, 5 * group, d, bits, group)
    dst.codes.random_(0, 256, generator=gen(51))  # stale contents are overwritten
    quantize_keys_into(dst, k[:, :, : 2 * group], 0)  # two groups at once (a prefill chunk)
    for j in range(2, 5):  # then one group at a time, as tokens leave the residual window
        quantize_keys_into(dst, k[:, :, j * group : (j + 1) * group], j * group)
    _assert_same(dst, quantize_keys(k, bits, group))
    _assert_same(dst.prefix(2 * group), quantize_keys(k[:, :, : 2 * group], bits, group))
    with pytest.raises(ValueError):
        quantize_keys_into(dst, k[:, :, :group], group // 2)
    with pytest.raises(ValueError):
        quantize_keys_into(dst, k[:, :, :group], 5 * group)  # past the capacity


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_values_into_equals_one_shot(bits, group):
    b, h, d = 2, 3, 64
    n = 3 * VALUE_BLOCK
    v = kv_like(b, h, n, d, seed=60)
    dst = empty_values(b, h, n, d, bits, group)
    dst.codes.random_(0, 256, generator=gen(61))  # stale contents are overwritten
    t = 0
    for run in [1, 5, 64, 13, 1, 1, 40, 30, 2]:  # token by token and in odd runs
        quantize_values_into(dst, v[:, :, t : t + run], t)
        t += run
    for _ in range(n - t):  # the rest one token at a time
        quantize_values_into(dst, v[:, :, t : t + 1], t)
        t += 1
    _assert_same(dst, quantize_values(v, bits, group))
    # a prefix of the one-shot result equals quantizing the prefix (partial last block)
    m = VALUE_BLOCK + 9
    torch.testing.assert_close(dequantize_values(dst, m), dequantize_values(quantize_values(v[:, :, :m], bits, group)))
    with pytest.raises(ValueError):
        quantize_values_into(dst, v[:, :, :2], n - 1)


def test_bad_arguments():
    with pytest.raises(ValueError):
        quantize_keys(torch.zeros(1, 1, 64, 8), 3, 64)
    with pytest.raises(ValueError):
        quantize_keys(torch.zeros(1, 1, 40, 8), 1, 32)  # L % g
    with pytest.raises(ValueError):
        quantize_values(torch.zeros(1, 1, 4, 48), 1, 32)  # D % g


@pytest.mark.parametrize("d", [32, 64, 96, 256])
def test_hadamard_is_orthogonal(d):
    r = hadamard(d)
    torch.testing.assert_close(r @ r.T, torch.eye(d), rtol=0, atol=1e-6)
    assert (r.abs() > 0).sum() == d * (d & -d)  # dense within each block


def test_a_rotation_spreads_an_outlier_channel_before_quantizing():
    """Values with one channel 20x the others (per-token groups: that channel sets every group's
    range): the 1-bit guide of V R, rotated back, reconstructs V closer than the guide of V itself.
    Keys, per channel, gain nothing from it; the rotated guide's scores with rotated queries are those
    of its keys rotated back (q . k = (q R) . (k R))."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 2, 128, 64, generator=g)
    v[..., 5] *= 20
    r = rotation_matrix("hadamard", 64)
    plain = quant.dequantize_values(quant.quantize_values(v, 1, 64))
    back = quant.dequantize_values(quant.quantize_values(v @ r, 1, 64)) @ r.T
    assert (back - v).norm() < 0.8 * (plain - v).norm()
    k = torch.randn(1, 2, 128, 64, generator=g)
    rotated = quant.quantize_keys(k @ r, 1, 32)
    q = torch.randn(1, 2, 3, 64, generator=g)
    keys_back = quant.dequantize_keys(rotated) @ r.T
    torch.testing.assert_close(quant.guide_scores(q @ r, rotated, 128), q @ keys_back.transpose(-1, -2),
                               rtol=1e-4, atol=1e-3)
    assert rotation_matrix("none", 64) is None
    with pytest.raises(ValueError):
        rotation_matrix("givens", 64)


def test_outlier_channels_are_kept_at_4_bits_beside_the_1_bit_guide():
    """Keys whose channels 5 and 40 are 20x / +9 the others: the guide with 2 outlier channels chooses
    them (per KV head, from its first keys), its scores are the main 1-bit guide's of the Hadamard-rotated
    keys with those channels zeroed before the rotation, plus the 4-bit side guide's (the reference:
    tests/conftest.kivi_guide_part / outlier_keys_reference), and they are closer to the exact scores
    than the plain 1-bit guide's of the same keys. Its bytes are what engine.kvcache.sizes counts."""
    from engine.kvcache.guide import Guide, GuideSpec
    from engine.kvcache.outliers import pack, unpack
    from engine.kvcache.sizes import guide_bytes, guide_capacity
    from tests.conftest import kivi_guide_part

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 256, 64, generator=gen)
    k[..., 5] *= 20
    k[..., 40] += 9
    v = torch.randn(1, 3, 256, 64, generator=gen)
    q = torch.randn(1, 3, 6, 64, generator=gen)
    side = Guide(1, 3, 300, 64, GuideSpec(1, 32, "hadamard", 2), torch.device("cpu"))
    plain = Guide(1, 3, 300, 64, GuideSpec(1, 32, "none"), torch.device("cpu"))
    for g in (side, plain):
        g.add(0, 0, k[:, :, :96], v[:, :, :96])
        g.add(0, 96, k[:, :, 96:], v[:, :, 96:])
    assert side.outliers.idx[0].tolist() == [[5, 40]] * 3
    ref_keys, _ = kivi_guide_part(k, v, 256, 1, 32, 32, 0, rotation_matrix("hadamard", 64), 2, 96)
    exact = q @ k.transpose(-1, -2)
    scores = side.scores(q, slice(0, 1), 256)
    torch.testing.assert_close(scores, q @ ref_keys.transpose(-1, -2), rtol=1e-4, atol=1e-3)
    assert (scores - exact).norm() < 0.5 * (plain.scores(q, slice(0, 1), 256) - exact).norm()
    codes = torch.randint(0, 16, (4, 7), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes), 7), codes)
    allocated = sum(t.numel() * t.element_size() for t in side.tensors())
    layer = type("Shape", (), {"layers": 1, "kv_heads": 3, "head_dim": 64})
    assert allocated == guide_bytes(layer, guide_capacity(300, 32), 1, 32, outliers=2)
    assert side.bytes(256) - plain.bytes(256) == 3 * (256 * (1 + 2 * 4 / 32) + 2 * 8)


@pytest.mark.parametrize("head_dim,group,channels", [(96, 64, 32), (96, 128, 32), (64, 128, 64), (128, 64, 64)])
def test_value_groups_divide_every_head(head_dim, group, channels):
    """Values are quantized in groups of gcd(group, head_dim) channels (Phi-3's heads of 96 with the default
    group 64: 32), so a guide exists for every head size the models have; its values reconstruct as the
    reference says."""
    from engine.kvcache.guide import Guide, GuideSpec
    from engine.kvcache.sizes import value_group

    assert value_group(group, head_dim) == channels
    guide = Guide(1, 2, 256, head_dim, GuideSpec(2, group), torch.device("cpu"))
    assert guide.values.group == channels
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 2 * group, head_dim, generator=gen), torch.randn(1, 2, 2 * group, head_dim, generator=gen)
    guide.add(0, 0, k, v)
    p = torch.rand(1, 2, 3, 2 * group, generator=gen)
    want = quant.guide_weighted_values_reference(p, guide.values, 2 * group)
    torch.testing.assert_close(guide.weighted_values(p, slice(0, 1), 2 * group), want, rtol=1e-4, atol=1e-4)
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("rotation,outliers", [("none", 0), ("hadamard", 2)])
def test_keys_beyond_fp16_give_finite_guide_scores(bits, rotation, outliers):
    """A key channel past fp16's range (65504) must not make the guide's fp16 scale / zero inf (and its
    scores inf or nan): they saturate, every score stays finite, in the torch and native paths."""
    from engine.kvcache.guide import Guide, GuideSpec

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 128, 64, generator=gen)
    k[..., 7] = 2e5  # a constant channel beyond fp16
    k[:, :, ::3, 9] = -1e6
    g = Guide(1, 2, 128, 64, GuideSpec(bits, 64, rotation, outliers), torch.device("cpu"))
    g.add(0, 0, k, torch.randn(1, 2, 128, 64, generator=gen) * 1e5)
    q = torch.randn(1, 2, 3, 64, generator=gen)
    assert torch.isfinite(g.scores(q, slice(0, 1), 128)).all()
    p = torch.softmax(torch.randn(1, 2, 3, 128, generator=gen), -1)
    assert torch.isfinite(g.weighted_values(p, slice(0, 1), 128)).all()


def test_a_constant_key_offset_costs_the_guide_nothing():
    """Qwen2's large key channels are k_proj biases (after RoPE, constant over tokens on the slow channels:
    mean -355, std 1.5 in Qwen2.5-Coder-1.5B's layer 0): the keys' per-channel zero points (groups of g
    tokens) absorb a constant, with or without the rotation, so the scores move by q . c alone (the same for
    every position: softmax does not see it) up to fp16's rounding of the zeros."""
    from engine.kvcache.guide import Guide, GuideSpec

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 256, 64, generator=gen)
    c = torch.zeros(64)
    c[[60, 61, 62, 63]] = torch.tensor([-355.0, 320.0, 290.0, -280.0])
    q = torch.randn(1, 2, 4, 64, generator=gen) * 3
    for rotation in ("none", "hadamard"):
        errs = []
        for offset in (torch.zeros(64), c):
            g = Guide(1, 2, 256, 64, GuideSpec(2, 64, rotation, 0), torch.device("cpu"))
            g.add(0, 0, k + offset, k)
            s = g.scores(q, slice(0, 1), 256) - q @ (k + offset).transpose(-1, -2)
            errs.append((s - s.mean(-1, keepdim=True)).std())  # a constant per query does not count
        assert errs[1] < 1.05 * errs[0], rotation


def test_auto_rotation_is_measured_per_layer_and_travels_with_the_row():
    """``auto`` (the default): keys with a few channels that jump by 40 on one token in 16 (like Gemma 3's
    global layers' keys): the Hadamard would spread those jumps over every channel's per-channel range, so
    the guide keeps none; keys and values without such channels keep the Hadamard. The choice
    is exported with a row and taken by a fresh cache's guide (a decided one with the other choice refuses)."""
    from engine.kvcache.guide import Guide, GuideSpec

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 128, 64, generator=gen)
    keys[..., :8] += (torch.rand(1, 2, 128, 1, generator=gen) < 1 / 16).float() * 40
    q = torch.randn(1, 2, 12, 64, generator=gen)
    v = torch.randn(1, 2, 128, 64, generator=gen)
    spiky = Guide(1, 2, 128, 64, GuideSpec(2, 64, "auto", 2), torch.device("cpu"))
    spiky.add(0, 0, keys, v, q)
    plain = Guide(1, 2, 128, 64, GuideSpec(2, 64, "auto", 2), torch.device("cpu"))
    v_spiky = v.clone()
    v_spiky[..., 5] *= 20  # a value channel 20x the others: the rotation helps the values
    plain.add(0, 0, torch.randn(1, 2, 128, 64, generator=gen), v_spiky, torch.randn(1, 2, 12, 64, generator=gen))
    assert not spiky.rotated and plain.rotated and not spiky.auto and not plain.auto
    exact = q @ keys.transpose(-1, -2)
    rotated = Guide(1, 2, 128, 64, GuideSpec(2, 64, "hadamard", 2), torch.device("cpu"))
    rotated.add(0, 0, keys, v)
    assert (spiky.scores(q, slice(0, 1), 128) - exact).norm() < (rotated.scores(q, slice(0, 1), 128) - exact).norm()
    saved = {n: t.clone() for n, t in spiky.export_row(0, 128).items()}
    assert int(saved["rotated"]) == 0
    fresh = Guide(1, 2, 128, 64, GuideSpec(2, 64, "auto", 2), torch.device("cpu"))
    fresh.import_row(0, 128, saved, check=True)
    fresh.import_row(0, 128, saved)
    assert not fresh.rotated and not fresh.auto
    torch.testing.assert_close(fresh.scores(q, slice(0, 1), 128), spiky.scores(q, slice(0, 1), 128))
    with pytest.raises(ValueError):
        plain.import_row(0, 128, saved, check=True)
