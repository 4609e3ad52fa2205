"""GGUF models (engine/model/gguf_files.py, sources.py): every block format the engine holds rebuilds
gguf.quants.dequantize's weights bit for bit, and the kernels on them agree with the fp32 ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as Q

from engine import native
from engine.model.gguf_files import held_from_raw
from engine.model.linears import SkinnyLinear, native_linear

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
    # bit for bit, except that affine4's Q4_0 rebuilds q = 8 as +0 where gguf's d * (q - 8) gives -0 for a
    # negative d: equal values, and the same products in any sum
    assert torch.equal(got, ref)
    if kind != Q.Q4_0:
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(held.rows(5, 9), ref[5:9])


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("kind", (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K), ids=lambda k: k.name)
@pytest.mark.parametrize("rows", (1, 3, 8))
def test_native_formats_give_the_fp32_kernel_result_bit_for_bit(kind, rows):
    n, k = 96, 512
    held = held_from_raw(random_tensor(kind, n, k, seed=rows), kind, n, k)
    assert held.kind in ("affine4", "scaled8")
    x = torch.randn(rows, k)
    ref = native_linear(x, held.unpack(), None)
    assert torch.equal(held.decode(x, None), ref)


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
    from engine.model import gguf_files

    tensors = {f"t.{kind.name}": (kind, random_tensor(kind, 40, 512, seed=i))
               for i, kind in enumerate((Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q8_0, Q.F16))}
    path = tmp_path / "t.gguf"
    write_tensors(path, tensors)
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    tf = gguf_files.TensorFile(path)
    monkeypatch.setattr(gguf_files, "CHUNK_BYTES", 3000)  # a few rows at a time
    for name, (kind, raw) in tensors.items():
        info = tf.tensors[name]
        assert (info.kind, info.ne, info.offset, info.n_bytes) == \
            (kind, tuple(int(x) for x in ref[name].shape), ref[name].data_offset, ref[name].n_bytes)
        assert np.array_equal(tf.raw(name), raw)
        whole = gguf_files.held_from_file(tf, name)
        assert torch.equal(whole.unpack(), torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32)))
        order = np.arange(40)[::-1].copy()
        assert torch.equal(gguf_files.held_from_file(tf, name, order).unpack(), whole.unpack()[order])


@pytest.mark.parametrize("kind", (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K), ids=lambda k: k.name)
def test_native_formats_rebuild_the_same_floats_in_torch(kind):
    """Without the native library (SPECACHE_NATIVE=0) the blocks are rebuilt by torch: same floats."""
    n, k = 24, 512
    raw = random_tensor(kind, n, k)
    held = held_from_raw(raw, kind, n, k)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))
    assert torch.equal(held.torch_rows(0, n), ref) and torch.equal(held.torch_rows(3, 7), ref[3:7])
