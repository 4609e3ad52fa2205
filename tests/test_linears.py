"""Packed weights (engine/model/held_weights.py, linears.py): a weight that is exactly a block format is
packed, rebuilds bit for bit, and the packed kernel gives the fp32 kernel's result bit for bit; anything
else is left alone."""
from __future__ import annotations

import pytest
import torch

from engine import native
from engine.model.held_weights import native_linear, pack_weight, packed_linear
from engine.model.linear_passes import prefill_pass
from engine.model.linears import SkinnyLinear, use_skinny_linears

pytestmark = [pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here"),
              pytest.mark.kernels]


def affine4_weight(n, k, seed=0):
    """Weights that are exactly m + d * q per block of 32 (d, m fp16 values, q in 0..15), like Q4_1."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the block's min and max codes, as a quantizer makes them
    return torch.addcmul(m, d, q).reshape(n, k)


def scaled8_weight(n, k, seed=0):
    """Weights that are exactly d * q per block of 32 (d fp16, q int8 with |q| max 127), like Q8_0."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


@pytest.mark.parametrize("make, fmt, ratio", [(affine4_weight, 4, 24 / 128), (scaled8_weight, 8, 36 / 128)])
def test_exact_block_weights_pack_and_rebuild_bit_for_bit(make, fmt, ratio):
    w = make(70, 192)
    packed = pack_weight(w)
    assert packed is not None and packed.fmt == fmt
    assert packed.nbytes == pytest.approx(w.numel() * 4 * ratio)
    assert torch.equal(packed.unpack(), w)


@pytest.mark.parametrize("make", [affine4_weight, scaled8_weight, None], ids=["affine4", "scaled8", "fp32"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(make):
    """Each row of an R-row call equals the 1-row call bit for bit (R = 2..8; fp32 with K not a multiple of
    32 too): exact mode's verification of gamma + 1 rows must reproduce the one-row steps of the full
    cache, or greedy text can part at a near-tie."""
    for n, k in ((130, 576), (70, 200)) if make is None else ((130, 576),):
        w = make(n, k, seed=3) if make is not None else torch.randn(n, k)
        packed = pack_weight(w) if make is not None else None
        x, bias = torch.randn(8, k), torch.randn(n)
        with torch.no_grad():
            call = (lambda v: packed_linear(v, packed, bias)) if packed is not None else (
                lambda v: native_linear(v, w, bias))
            alone = torch.cat([call(x[i: i + 1]) for i in range(8)])
            for r in range(2, 9):
                assert torch.equal(call(x[:r]), alone[:r]), (n, k, r)


@pytest.mark.parametrize("make", [affine4_weight, scaled8_weight])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_packed_kernel_equals_fp32_kernel_bit_for_bit(make, rows):
    w = make(300, 576, seed=rows)
    bias = torch.randn(300)
    x = torch.randn(rows, 576)
    packed = pack_weight(w)
    with torch.no_grad():
        for b in (None, bias):
            got = packed_linear(x, packed, b)
            assert got is not None
            assert torch.equal(got, native_linear(x, w, b))
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_16bit_weights_decode_natively_as_the_fp32_kernel_on_their_floats(dtype, rows):
    """A bf16 / fp16 weight held as it is (a GGUF's F16 / BF16 tensor, a folder's 16-bit safetensors): the
    native kernel reads its 2-byte weights (fmt 12 / 13) and gives the fp32 kernel's result on the converted
    weight bit for bit, subnormals and the extremes of the range included; K % 32 != 0 declines (tiles)."""
    from engine.model.held_weights import DenseWeight

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(300, 576, generator=g) * 0.05).to(dtype)
    w[0, :8] = torch.tensor([torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 8, torch.finfo(dtype).max,
                             -torch.finfo(dtype).max, 0.0, -0.0, 1.0, torch.finfo(dtype).eps], dtype=dtype)
    x, bias = torch.randn(rows, 576, generator=g) * 1e-3, torch.randn(300, generator=g)
    held = DenseWeight(w)
    assert held.nbytes == w.numel() * 2
    for b in (None, bias):
        got = held.decode(x, b)
        assert got is not None and torch.equal(got, native_linear(x, w.float(), b))
    assert DenseWeight(w[:, :100].contiguous()).decode(x[:, :100], None) is None
    lin = SkinnyLinear(576, 300)  # a prefill chunk in bf16: a bf16 weight multiplies as it is (no tiles)
    lin.weight, lin.held, lin.bias = None, held, torch.nn.Parameter(bias, requires_grad=False)
    chunk = torch.randn(80, 576, generator=g)
    want = torch.nn.functional.linear(chunk.bfloat16(), w.bfloat16() if dtype == torch.bfloat16 else w.float().bfloat16())
    got = lin.tiled_forward(chunk, torch.bfloat16)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want.float() + bias, rtol=0, atol=0, equal_nan=True)  # row 0: inf - inf
    else:  # fp16 tiles rebuilt and rounded to bf16
        torch.testing.assert_close(got, want.float() + bias, rtol=2e-2, atol=2e-2)


def test_weights_that_are_not_exact_blocks_stay_unpacked():
    assert pack_weight(torch.randn(64, 128)) is None  # ordinary float weights
    w = affine4_weight(64, 128)
    w[10, 37] += 1e-4  # one weight off its block's grid
    assert pack_weight(w) is None
    assert pack_weight(affine4_weight(8, 96)[:, :80].contiguous()) is None  # K not a multiple of 32
    assert pack_weight(affine4_weight(8, 64).double()) is None  # not fp32


def test_use_skinny_linears_packs_exact_weights_and_the_module_output_is_unchanged(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(affine4_weight(64, 128))
        model[1].weight.copy_(torch.randn(32, 64))
    x = torch.randn(2, 128)
    with torch.no_grad():
        want = model(x)
        use_skinny_linears(model)
        assert isinstance(model[0], SkinnyLinear) and model[0].packed is not None and model[1].packed is None
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # weights changed after preparing: preparing again packs them anew
        model[0].weight.copy_(affine4_weight(64, 128, seed=5))
        use_skinny_linears(model)
        assert torch.equal(model[0].packed.unpack(), model[0].weight)
    fresh = torch.nn.Linear(128, 64)
    with torch.no_grad():
        fresh.weight.copy_(affine4_weight(64, 128))
    monkeypatch.setenv("SPECACHE_PACK_WEIGHTS", "0")
    use_skinny_linears(fresh)
    assert fresh.packed is None


def test_packed_kernel_declines_what_it_cannot_do():
    packed = pack_weight(affine4_weight(16, 64))
    x = torch.randn(2, 64)
    assert packed_linear(x.double(), packed, None) is None  # not fp32
    assert packed_linear(torch.randn(2, 96), packed, None) is None  # wrong width
    assert packed_linear(torch.randn(64, 2).t(), packed, None) is None  # rows not contiguous
    with torch.enable_grad():
        assert packed_linear(x.requires_grad_(), packed, None) is None  # autograd wants torch


@pytest.mark.parametrize("packed", [True, False])
def test_up_to_native_rows_take_the_native_kernel_in_chunks(packed, monkeypatch):
    """A verification of batch x (gamma + 1) rows (9..NATIVE_ROWS) outside a prefill pass: the native
    kernel in calls of SKINNY_ROWS rows (each call's rows bit for bit what that call alone gives);
    more rows take torch's GEMM."""
    if not packed:
        monkeypatch.setenv("SPECACHE_PACK_WEIGHTS", "0")
    layer = torch.nn.Linear(576, 300)
    with torch.no_grad():
        layer.weight.copy_(affine4_weight(300, 576, seed=3))
        use_skinny_linears(layer)
        assert (layer.packed is not None) == packed
        calls = []
        real = SkinnyLinear.native
        monkeypatch.setattr(SkinnyLinear, "native", lambda self, flat: calls.append(flat.shape[0]) or real(self, flat))
        x = torch.randn(28, 576)
        got = layer(x[None])[0]  # [1, 28, K]: rows counted over the leading dims
        assert calls == [8, 8, 8, 4]
        for s in (0, 8, 24):  # each chunk's rows are what that call alone gives
            assert torch.equal(got[s : s + 8], layer(x[s : s + 8]))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
        calls.clear()
        layer(torch.randn(SkinnyLinear.NATIVE_ROWS + 1, 576))
        assert calls == []  # many rows: torch


def test_exact_mode_takes_the_one_row_kernel_for_every_row_count(monkeypatch):
    """Where the calibration keeps the native kernel for one row only, a 12-row pass inside row_invariant()
    (exact mode's drafts and verification) still takes it, in calls of 8: each row is the one-row step's
    result bit for bit; outside, the 12 rows take torch's GEMM as calibrated."""
    from engine.model.linear_passes import row_invariant
    from engine.native import calibrate

    monkeypatch.setattr(calibrate, "use_native", lambda form, rows: rows == 1)
    layer = torch.nn.Linear(576, 300)
    with torch.no_grad():
        layer.weight.copy_(affine4_weight(300, 576, seed=5))
        use_skinny_linears(layer)
        calls = []
        real = SkinnyLinear.native
        monkeypatch.setattr(SkinnyLinear, "native", lambda self, flat: calls.append(flat.shape[0]) or real(self, flat))
        x = torch.randn(12, 576)
        alone = torch.cat([layer(x[i: i + 1]) for i in range(12)])
        calls.clear()
        layer(x)
        assert calls == []  # calibrated: torch for 12 rows
        with row_invariant():
            got = layer(x)
        assert calls == [8, 4] and torch.equal(got, alone)


def test_prefill_linears_in_bf16_only_for_many_rows_and_only_when_asked():
    """use_skinny_linears(prefill_dtype=bf16): prefill chunks (> 8 rows) multiply a bf16 copy of the
    weight (results within bf16 rounding of fp32, returned in fp32); decode rows keep the exact
    fp32/packed kernels; without a prefill dtype (the default) every result is fp32's."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(affine4_weight(64, 128))
    x_many, x_few = torch.randn(40, 128), torch.randn(3, 128)
    with torch.no_grad():
        want_many, want_few = model(x_many), model(x_few)
        use_skinny_linears(model, torch.bfloat16)
        assert model[0].prefill_dtype == torch.bfloat16
        torch.testing.assert_close(model(x_many), want_many, rtol=1e-5, atol=1e-5)  # not a prefill pass: exact
        with prefill_pass():
            got = model(x_many)
        assert got.dtype == torch.float32 and model[0]._prefill_weight.dtype == torch.bfloat16
        assert not torch.equal(got, want_many)  # really computed in bf16
        torch.testing.assert_close(got, want_many, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(model(x_few), want_few, rtol=1e-5, atol=1e-5)  # decode rows: exact path
        use_skinny_linears(model)  # back to exact
        assert model[0].prefill_dtype is None
        with prefill_pass():
            torch.testing.assert_close(model(x_many), want_many, rtol=1e-5, atol=1e-5)
        use_skinny_linears(model.to(torch.bfloat16), torch.bfloat16)  # a bf16 model: nothing to change
        assert model[0].prefill_dtype is None


def test_dtype_rule(monkeypatch):
    """--dtype auto: fp32 on the CPU, prefill in bf16 only where the CPU has native bf16; float32
    is all exact; bfloat16 is bf16 with the native prefill attention where it can run."""
    from engine.errors import BadArgument
    from engine.model import loading

    cpu = torch.device("cpu")
    for native_bf16 in (True, False):
        monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda v=native_bf16: v)
        fast = torch.bfloat16 if native_bf16 else None
        assert loading.resolve_dtype("auto", cpu) == (torch.float32, fast)
        assert loading.resolve_dtype("float32", cpu) == (torch.float32, None)
        assert loading.resolve_dtype("bfloat16", cpu) == (torch.bfloat16, fast)
        assert loading.resolve_dtype("auto", torch.device("cuda")) == (torch.float16, None)
    with pytest.raises(BadArgument):
        loading.resolve_dtype("float8", cpu)


def test_native_bf16_needs_the_flags_and_a_torch_allowed_to_use_them(monkeypatch):
    """bf16 prefill only where the CPU has the instructions and torch is not held below AVX-512 (the
    AVX2 stand-in: ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 emulate bf16 in a scalar loop)."""
    from engine.model import linear_passes

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(linear_passes.native, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert linear_passes.cpu_has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not linear_passes.cpu_has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_amx")
    assert linear_passes.cpu_has_native_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not linear_passes.cpu_has_native_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(linear_passes.native, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert not linear_passes.cpu_has_native_bf16()
