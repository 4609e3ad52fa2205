"""GGUF models (engine/model/gguf_header.py, gguf_tensors.py, gguf_convert.py, sources.py): every block format
the engine holds rebuilds gguf.quants.dequantize's weights bit for bit, and the kernels on them agree with the
fp32 ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as Q

from engine import native
from engine.model.gguf_tensors import held_from_raw
from engine.model.held_weights import native_linear
from engine.model.linears import SkinnyLinear

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
ALL = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS, Q.F16, Q.BF16, Q.F32)
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the fp16 scales


def random_tensor(kind: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A tensor of kind as GGUF bytes [n, bytes per row]: quantized by gguf.quants where it can, else
    (K-quants) random blocks with finite fp16 scales of either sign."""
    rng = np.random.default_rng(seed)
    if kind not in K_QUANTS:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(w, kind).view(np.uint8).reshape(n, -1)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[kind]:
        raw[:, off:off + 2] = (rng.standard_normal(len(raw)) * 1e-3).astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("kind", ALL, ids=lambda k: k.name)
def test_each_gguf_format_rebuilds_gguf_dequantize_bit_for_bit(kind):
    n, k = 24, 512
    raw = random_tensor(kind, n, k)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))
    held = held_from_raw(raw, kind, n, k)
    got = held.unpack()
    assert got.dtype == torch.float32 and got.shape == (n, k)
    # bit for bit, except that Q4_0 / Q5_0 rebuild q = 8 / 16 as fma(d, q, -8 d) = +0 where gguf's d * (q - 8)
    # gives -0 for a negative d: equal values, and the same products in any sum
    assert torch.equal(got, ref)
    if kind not in (Q.Q4_0, Q.Q5_0):
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(held.rows(5, 9), ref[5:9])


NATIVE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # the formats with a native decode kernel


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("kind", NATIVE, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", (1, 2, 3, 8))
def test_native_formats_give_the_fp32_kernel_result_bit_for_bit(kind, rows):
    n, k = 96, 512
    held = held_from_raw(random_tensor(kind, n, k, seed=rows), kind, n, k)
    block, size = gguf.GGML_QUANT_SIZES[kind]  # held in the file's own blocks: no byte more than the GGUF
    assert held.kind == kind.name.lower() and held.nbytes == n * k // block * size
    x, bias = torch.randn(rows, k), torch.randn(n)
    w = held.unpack()
    for b in (None, bias):
        got = held.decode(x, b)
        assert got is not None and torch.equal(got, native_linear(x, w, b))
        # torch's own sum order differs (AVX2 BLAS: 2e-5 on outputs ~0.3 for Q6_K's 512-term rows)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def q6k_edge_tensor(n: int, k: int) -> np.ndarray:
    """Q6_K blocks whose codes take every value 0..63 and whose scales take -128, -1, 0, 1 and 127, under
    an fp16 d that is subnormal, negative, zero, tiny and large."""
    raw = random_tensor(Q.Q6_K, n, k, seed=7).reshape(-1, 210)
    q = np.arange(256) % 64  # every code, ql / qh set so that weight i of block 0 has code i % 64
    half, quarter, t = q // 128, (q % 128) // 32, q % 32
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for i in range(256):
        h, c, j = half[i], quarter[i], t[i]
        ql[64 * h + 32 * (c & 1) + j] |= (q[i] & 15) << (4 * (c >> 1))
        qh[32 * h + j] |= (q[i] >> 4) << (2 * c)
    raw[0, :128], raw[0, 128:192] = ql, qh
    raw[:, 192:197] = np.array([-128, -1, 0, 1, 127], np.int8).view(np.uint8)
    for i, d in enumerate((0x0001, 0x83FF, 0x0000, 0x8000, 0x0400, 0x7BFF)):  # subnormals, +-0, smallest normal, max
        raw[i + 1, 208:210] = np.array([d], np.uint16).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
def test_q6k_edge_values_rebuild_and_multiply_bit_for_bit():
    n, k = 4, 512  # 8 superblocks
    raw = q6k_edge_tensor(n, k)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K).reshape(n, k).astype(np.float32))
    held = held_from_raw(raw, Q.Q6_K, n, k)
    assert torch.equal(held.unpack().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(held.torch_rows(0, n).view(torch.int32), ref.view(torch.int32))
    x = torch.randn(3, k)
    assert torch.equal(held.decode(x, None), native_linear(x, ref, None))


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("kind", (Q.Q4_K, Q.Q5_K), ids=lambda k: k.name)
def test_kquant_edge_values_rebuild_and_multiply_bit_for_bit(kind):
    """Q4_K / Q5_K superblocks whose 6-bit scales and mins are all 0 or all 63 and whose codes are all 0 or
    all ones, under fp16 d and dmin that are subnormal, +-0, the smallest normal and the largest."""
    n, k = 6, 512  # 12 superblocks
    raw = random_tensor(kind, n, k, seed=11).reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
    raw[0:4, 4:] = 0xFF  # scales, mins 63 (and every code 15 / 31)
    raw[4:6, 4:] = 0x00
    halves = (0x0001, 0x83FF, 0x0000, 0x8000, 0x0400, 0x7BFF)
    for i, h in enumerate(halves):
        raw[i, 0:2] = np.array([h], np.uint16).view(np.uint8)
        raw[i + 6, 2:4] = np.array([h], np.uint16).view(np.uint8)
    raw = raw.reshape(n, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))
    held = held_from_raw(raw, kind, n, k)
    assert torch.equal(held.unpack().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(held.torch_rows(0, n).view(torch.int32), ref.view(torch.int32))
    x = torch.randn(3, k)
    assert torch.equal(held.decode(x, None), native_linear(x, ref, None))


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("kind", (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1), ids=lambda k: k.name)
def test_block_edge_values_rebuild_and_multiply_bit_for_bit(kind):
    """Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 blocks (the file's own, fp16 scales) whose codes are all 0, all ones
    or every value, under fp16 d (and m) that are subnormal, +-0, the smallest normal and the largest: the
    native rebuild, torch's and the kernel's product all give gguf.quants' floats."""
    n, k = 6, 256  # 8 blocks a row
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = random_tensor(kind, n, k, seed=13).reshape(-1, size)
    has_min = kind in (Q.Q4_1, Q.Q5_1)
    codes = 2 + 2 * has_min  # byte offset of the codes (Q5: qh, then qs)
    raw[0:8, codes:] = 0xFF
    raw[8:16, codes:] = 0x00
    raw[16:24, codes:] = np.arange(size - codes, dtype=np.uint8) * (17 if kind != Q.Q8_0 else 9)
    halves = (0x0001, 0x83FF, 0x0000, 0x8000, 0x0400, 0x7BFF, 0xFBFF, 0x3C00)
    for i, h in enumerate(halves):
        raw[i :: len(halves), 0:2] = np.array([h], np.uint16).view(np.uint8)
        if has_min:
            raw[(i + 3) % len(halves) :: len(halves), 2:4] = np.array([h], np.uint16).view(np.uint8)
    raw = raw.reshape(n, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))
    held = held_from_raw(raw, kind, n, k)
    for got in (held.unpack(), held.torch_rows(0, n)):
        assert torch.equal(got, ref)  # Q4_0 / Q5_0: fma(d, 8, -8 d) is +0 where gguf's d * 0 is -0 (d < 0)
        if kind not in (Q.Q4_0, Q.Q5_0):
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    x = torch.randn(3, k)
    assert torch.equal(held.decode(x, None), native_linear(x, ref, None))


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
def test_q6k_decode_declines_what_it_cannot_do(monkeypatch):
    n, k = 16, 512
    held = held_from_raw(random_tensor(Q.Q6_K, n, k), Q.Q6_K, n, k)
    x = torch.randn(2, k)
    assert held.decode(torch.randn(9, k), None) is None  # more than 8 rows: the caller's chunks of 8
    assert held.decode(x.double(), None) is None  # not fp32
    assert held.decode(torch.randn(2, 768), None) is None  # wrong width
    assert held.decode(torch.randn(k, 2).t(), None) is None  # rows not contiguous
    with torch.enable_grad():
        assert held.decode(x.clone().requires_grad_(), None) is None  # autograd wants torch
    w = held.unpack()
    monkeypatch.setattr(native, "_lib", None)  # no native library: no decode kernel, torch rebuilds the rows
    bare = held_from_raw(random_tensor(Q.Q6_K, n, k), Q.Q6_K, n, k)
    assert bare.decode(x, None) is None and torch.equal(bare.rows(0, n), w)


def weightless_linear(held, bias=None) -> SkinnyLinear:
    lin = SkinnyLinear(held.shape[1], held.shape[0], bias=bias is not None)
    lin.weight = None
    lin.held = held
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias)
    return lin


@pytest.mark.parametrize("kind", (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.F16), ids=lambda k: k.name)
@pytest.mark.parametrize("rows", (1, 5, 40, 300))
def test_weightless_linear_matches_the_dequantized_weight(kind, rows):
    n, k = 200, 512
    held = held_from_raw(random_tensor(kind, n, k), kind, n, k)
    bias = torch.randn(n)
    lin = weightless_linear(held, bias)
    lin.TILE_ELEMENTS = 64 * k  # several tiles
    x = torch.randn(rows, k)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, held.unpack(), bias)
        got = lin(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("rows", (1, 5, 12))
def test_weightless_q6k_linear_takes_the_native_kernel_in_chunks_of_8(rows):
    """Decode rows of a Q6_K linear go through the native kernel on its blocks, 8 rows a call: bit for bit
    the fp32 kernel's result on the rebuilt weight, call by call (torch's tiles would round otherwise)."""
    n, k = 200, 512
    held = held_from_raw(random_tensor(Q.Q6_K, n, k, seed=rows), Q.Q6_K, n, k)
    bias = torch.randn(n)
    lin = weightless_linear(held, bias)
    x = torch.randn(rows, k)
    with torch.no_grad():
        got = lin(x[None])[0]
    w = held.unpack()
    want = torch.cat([native_linear(x[s : s + 8], w, bias) for s in range(0, rows, 8)])
    assert torch.equal(got, want)


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
def test_a_bf16_prefill_takes_the_exact_kernel_for_a_few_rows_and_nothing_for_none():
    """Within a bf16 prefill pass a held linear's 1-8 rows (the last chunk's lm_head row) take the exact native
    kernel on the blocks, not a rebuild of every tile for one row; no rows (the lm_head of a chunk before the
    last) read nothing and give [0, N]."""
    from engine.model.linear_passes import prefill_pass

    n, k = 200, 512
    held = held_from_raw(random_tensor(Q.Q4_K, n, k, seed=3), Q.Q4_K, n, k)
    lin = weightless_linear(held, torch.randn(n))
    lin.prefill_dtype = torch.bfloat16
    x = torch.randn(1, 3, k)
    with torch.no_grad(), prefill_pass():
        got, none = lin(x), lin(x[:, :0])
    assert torch.equal(got[0], native_linear(x[0], held.unpack(), lin.bias))
    assert none.shape == (1, 0, n)


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("kind", (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0), ids=lambda k: k.name)
@pytest.mark.parametrize("tile", (1 << 22, 64 * 512))
def test_a_bf16_prefill_rebuilds_its_tiles_in_bf16_as_torch_rounds_them(kind, tile):
    """Many rows in a bf16 prefill: the tiles come from the blocks straight in bf16 (native_rows), the same
    values as the fp32 rebuild rounded by torch, so the product is torch's bf16 GEMM on those, bit for bit,
    in one tile or several."""
    from engine.model.linear_passes import prefill_pass

    n, k = 200, 512
    held = held_from_raw(random_tensor(kind, n, k, seed=5), kind, n, k)
    assert torch.equal(held.rows(3, 70, torch.bfloat16), held.unpack()[3:70].to(torch.bfloat16))
    lin = weightless_linear(held, torch.randn(n))
    lin.prefill_dtype, lin.TILE_ELEMENTS = torch.bfloat16, tile
    x = torch.randn(40, k)
    with torch.no_grad(), prefill_pass():
        got = lin(x)
    w16 = held.unpack().to(torch.bfloat16)
    parts = [torch.nn.functional.linear(x.to(torch.bfloat16), w16[s : s + 64]) for s in range(0, n, 64)]
    want = (torch.nn.functional.linear(x.to(torch.bfloat16), w16) if tile > n * k else torch.cat(parts, 1)).float()
    assert torch.equal(got, want + lin.bias)


def write_tensors(path, tensors: dict) -> None:
    """A GGUF file holding the given raw tensors {name: (kind, raw bytes [n, row bytes])}."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, raw) in tensors.items():
        w.add_tensor(name, raw, raw_shape=None, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_header_reader_agrees_with_the_gguf_package_and_chunks_rebuild_whole(tmp_path, monkeypatch):
    from engine.model import gguf_tensors

    tensors = {f"t.{kind.name}": (kind, random_tensor(kind, 40, 512, seed=i))
               for i, kind in enumerate((Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q8_0, Q.F16))}
    path = tmp_path / "t.gguf"
    write_tensors(path, tensors)
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    tf = gguf_tensors.TensorFile(path)
    monkeypatch.setattr(gguf_tensors, "CHUNK_BYTES", 3000)  # a few rows at a time
    for name, (kind, raw) in tensors.items():
        info = tf.tensors[name]
        assert (info.kind, info.ne, info.offset, info.n_bytes) == \
            (kind, tuple(int(x) for x in ref[name].shape), ref[name].data_offset, ref[name].n_bytes)
        assert np.array_equal(tf.raw(name), raw)
        whole = gguf_tensors.held_from_file(tf, name)
        assert torch.equal(whole.unpack(), torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32)))
        if native.native_available() and kind in NATIVE:  # the decode kernel reads the whole, joined buffers
            x = torch.randn(2, 512)
            assert torch.equal(whole.decode(x, None), native_linear(x, whole.unpack(), None))
        order = np.arange(40)[::-1].copy()
        assert torch.equal(gguf_tensors.held_from_file(tf, name, order).unpack(), whole.unpack()[order])


@pytest.mark.parametrize("kind", NATIVE, ids=lambda k: k.name)
def test_native_formats_rebuild_the_same_floats_in_torch(kind):
    """Without the native library (SPECACHE_NATIVE=0) the blocks are rebuilt by torch: same floats."""
    n, k = 24, 512
    raw = random_tensor(kind, n, k)
    held = held_from_raw(raw, kind, n, k)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))
    assert torch.equal(held.torch_rows(0, n), ref) and torch.equal(held.torch_rows(3, 7), ref[3:7])
