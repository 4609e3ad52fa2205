"""The decode kernels of held GGUF block weights (engine/model/decode_kernels.py): the exact one is the fp32
product bit for bit (tests/test_gguf.py); the integer ones (engine/native/int8_linear.c: int8 or int16
activations) equal their torch reference to float rounding, stay within the stated bound of the exact
product, compute each row alone, and are taken only where declared."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import native
from engine.backends import native_cpu
from engine.model import decode_kernels as dk
from engine.model.gguf_tensors import held_from_raw
from engine.model.linear_passes import prefill_pass
from engine.model.linears import SkinnyLinear, use_skinny_linears
from tests.test_gguf import random_tensor

pytestmark = pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
INT_KINDS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def activations(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows with Gemma-like outliers: a few channels 50x the rest (the case per-block scales must survive)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, torch.randint(0, k, (4,), generator=g)] *= 50
    return x


def magnitude(x: torch.Tensor, held, bits: int) -> torch.Tensor:
    """[R, N]: the sum of the magnitudes of the reference's terms (the float-rounding tolerance's scale)."""
    q, dx, sums = dk.quantize_rows(x, bits)
    w, m = held.unpack().double(), dk.block_minus(held).double()
    xh = (q.double().view(x.shape[0], -1, 32) * dx.double()[..., None]).view(x.shape)
    return xh.abs() @ (w - m.repeat_interleave(32, dim=1)).abs().T + sums.double().abs() @ m.abs().T


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("kind", INT_KINDS, ids=lambda k: k.name)
def test_integer_kernels_equal_their_reference_and_stay_within_the_bound(kind, bits):
    n, k = 136, 512
    held = held_from_raw(random_tensor(kind, n, k, seed=3), kind, n, k)
    x, bias = activations(5, k), torch.randn(n)
    call = dk.decode_call(held, bias, f"int{bits}")
    assert call.kernel == f"int{bits}"
    got = call(x)
    ref = dk.int_reference(x, held, bias, bits)
    assert ((got - ref).abs() <= 1e-5 * magnitude(x, held, bits) + 1e-5).all()
    exact = held.decode(x, bias)
    assert ((got - exact).abs() <= dk.int_error_bound(x, held, bits)).all()
    assert not torch.equal(got, exact)  # a different computation: declared, never silent
    for r in range(x.shape[0]):  # each row alone: the one-row call's floats
        assert torch.equal(call(x[r : r + 1]), got[r : r + 1])


def test_int16_activations_are_much_closer_to_the_exact_product_than_int8():
    n, k = 256, 1024
    held = held_from_raw(random_tensor(Q.Q5_0, n, k, seed=1), Q.Q5_0, n, k)
    x = activations(1, k, seed=2)
    exact = held.decode(x, None)
    err = {bits: (dk.decode_call(held, None, f"int{bits}")(x) - exact).norm() / exact.norm() for bits in (8, 16)}
    assert err[16] < err[8] / 50 and err[16] < 1e-4


def test_the_kernel_quantizes_as_the_torch_reference_does():
    x = activations(1, 256)[0]
    for bits, dtype in ((8, torch.int8), (16, torch.int16)):
        q, d, s = torch.empty(256, dtype=dtype), torch.empty(8), torch.empty(8)
        assert native.lib().specache_int8_quantize_row(x.data_ptr(), 256, bits, q.data_ptr(), d.data_ptr(),
                                                       s.data_ptr()) == 0
        rq, rd, rs = dk.quantize_rows(x[None], bits)
        assert torch.equal(q, rq[0]) and torch.equal(d, rd[0]) and torch.equal(s, rs[0])


def test_the_choice_is_declared(monkeypatch):
    monkeypatch.delenv(dk.ENV, raising=False)
    want = {"avx512": "int16", "avx2": "int16"}.get(native.isa(), "exact")  # int16 where it was measured
    assert dk.choose() == native_cpu.DECODE_LINEAR_BY_ISA.get(native.isa(), "exact") == want
    for value in dk.CHOICES:
        monkeypatch.setenv(dk.ENV, value)
        assert dk.choose() == value
        assert dk.choose("exact") == "exact"  # an explicit setting wins over the environment
    monkeypatch.setenv(dk.ENV, "fast")
    with pytest.raises(ValueError, match="SPECACHE_DECODE_LINEAR"):
        dk.choose()


def held_linear(held) -> SkinnyLinear:
    lin = SkinnyLinear(held.shape[1], held.shape[0], bias=False)
    lin.weight, lin.held = None, held
    return lin


@pytest.mark.parametrize("kernel", ["exact", "int16"])
def test_a_held_linear_takes_the_chosen_kernel_in_decode_and_the_exact_one_in_prefill(kernel):
    n, k = 64, 256
    held = held_from_raw(random_tensor(Q.Q4_K, n, k), Q.Q4_K, n, k)
    model = torch.nn.Sequential(held_linear(held))
    use_skinny_linears(model, None, kernel)
    lin = model[0]
    assert lin.decoder is not None and lin.decoder.kernel == kernel
    x = activations(12, k)  # one row, 8 rows, and 12 (two calls of the held_forward chunks)
    want = held.decode(x[:1], None) if kernel == "exact" else dk.int_reference(x[:1], held, None, 16)
    with torch.inference_mode():
        one, many = lin(x[:1][None]), lin(x)
        with prefill_pass():
            pre = lin(x)
    assert one.shape == (1, 1, n) and torch.allclose(one[0], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(many[:1], one[0]) and torch.equal(many[8:9], lin(x[8:9]))  # row by row
    exact = torch.cat([held.decode(x[:8], None), held.decode(x[8:], None)])
    assert torch.equal(pre, exact)  # prefill chunks: the exact kernel whatever the choice
    assert torch.equal(many, exact) == (kernel == "exact")


def test_the_lean_call_declines_what_it_cannot_read():
    held = held_from_raw(random_tensor(Q.Q8_0, 32, 64), Q.Q8_0, 32, 64)
    call = dk.decode_call(held, None, "int8")
    assert call(torch.randn(9, 64)) is None  # more than 8 rows
    assert call(torch.randn(2, 64).double()) is None
    assert call(torch.randn(64, 2).t()) is None  # not contiguous
    assert call(torch.randn(2, 32)) is None  # wrong width
    assert call.kernel == "int8"
    dense = held_from_raw(random_tensor(Q.F32, 32, 64), Q.F32, 32, 64)
    assert dk.decode_call(dense, None, "int8") is None  # fp32 weights: the general path
