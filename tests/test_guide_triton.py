"""The guide's Triton kernels (engine/backends/triton_guide.py), run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1: the kernels' own code, executed with NumPy) against the dequantize-then-matmul
references of engine.kvcache.quant. Skipped where Triton is not installed (the `gpu` extra)."""
from __future__ import annotations

import pytest
import torch

from engine.backends import triton_guide
from engine.backends.triton_cuda import TritonCUDA
from engine.kvcache import quant

pytest.importorskip("triton")  # (on the CPU, tests/conftest.py has set TRITON_INTERPRET=1)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bits,group,d,nq", [(1, 32, 64, 1), (2, 64, 128, 6), (2, 32, 96, 12), (1, 128, 64, 17)])
def test_triton_scores_equal_the_reference(bits, group, d, nq):
    """q @ dequant(K)^T over the first n keys, for a slice of batch rows (strided rows), head dims that are
    not a power of two (padded) and query counts past the dot's 16 (padded to 32)."""
    gen = torch.Generator().manual_seed(bits * 100 + group)
    k = (torch.randn(3, 2, 4 * group, d, generator=gen) * 3).to(DEVICE)
    qk = quant.quantize_keys(k, bits, group)
    rows = slice(1, 3)
    sub = quant.QuantizedKeys(qk.codes[rows], qk.scale[rows], qk.zero[rows], bits, group)
    q = torch.randn(2, 2, nq, d, generator=gen).to(DEVICE)
    for n in (group, 3 * group):
        got = triton_guide.guide_scores(q, sub.codes, sub.scale, sub.zero, n, group, bits)
        want = quant.guide_scores_reference(q, sub, n)
        assert got.shape == (2, 2, nq, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert triton_guide.guide_scores(q, sub.codes, sub.scale, sub.zero, group + 8, group, bits) is None  # not a group


@pytest.mark.parametrize("bits,group,d,nq,n", [(1, 32, 64, 1, 64), (2, 64, 128, 6, 200), (2, 32, 96, 12, 130),
                                               (1, 64, 64, 20, 7)])
def test_triton_weighted_values_equal_the_reference(bits, group, d, nq, n):
    """p @ dequant(V) over the first n values (n not a multiple of the 64-token block), one program per head
    or the tokens split among several (partial sums added): the same result."""
    gen = torch.Generator().manual_seed(bits * 10 + d)
    v = (torch.randn(2, 3, 256, d, generator=gen) * 2).to(DEVICE)
    qv = quant.quantize_values(v, bits, group)
    p = torch.rand(2, 3, nq, n, generator=gen).to(DEVICE)
    want = quant.guide_weighted_values_reference(p, qv, n)
    for splits in (1, 3):
        got = triton_guide.guide_weighted_values(p, qv.codes, qv.scale, qv.zero, n, qv.group, bits, splits=splits)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_kernel_that_fails_is_said_once_and_the_fallback_takes_over(monkeypatch, capsys):
    """A launch error (a compiler or driver refusing the kernel) is one note on stderr; from then on that
    family's kernels are not used (None: quant's torch code computes the guide) while the other family's
    still are."""
    import engine.backends.triton_code.guide_kernels as tk

    class Refusing:
        def __getitem__(self, grid):
            def run(*args, **meta):
                raise RuntimeError("no kernel image for this device")
            return run

    monkeypatch.setattr(triton_guide, "FAILED", {})
    monkeypatch.setattr(tk, "scores_kernel", Refusing())
    triton_guide.kernels.cache_clear()
    qk = quant.quantize_keys(torch.randn(1, 2, 64, 32), 2, 32)
    q = torch.randn(1, 2, 3, 32)
    assert triton_guide.guide_scores(q, qk.codes, qk.scale, qk.zero, 64, 32, 2) is None
    assert not triton_guide.available("guide") and triton_guide.available("gather")
    assert triton_guide.guide_scores(q, qk.codes, qk.scale, qk.zero, 64, 32, 2) is None
    err = capsys.readouterr().err
    assert err.count("Triton kernel failed (RuntimeError: no kernel image for this device)") == 1
    assert "the torch code computes the guide" in err
    monkeypatch.undo()
    triton_guide.kernels.cache_clear()
    assert triton_guide.available("guide")


@pytest.fixture
def gather_here(monkeypatch):
    """The gather kernel where it runs (CUDA compiled, or CPU tensors in Triton's interpreter), a failure kept to
    the test (it would switch the gather off for the rest of the process)."""
    if DEVICE.type == "cpu" and not triton_guide.interpreted():
        pytest.skip("CPU tensors reach the gather kernel only in Triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(triton_guide, "FAILED", {})


def as_store(t: torch.Tensor) -> torch.Tensor:
    """t where the gather reads the exact store from: on CUDA page-locked host memory (mapped into the device's
    address space: a kernel reads it over the bus), else the CPU tensor itself."""
    return t.pin_memory() if DEVICE.type == "cuda" else t


def test_triton_gather_takes_the_selected_rows(gather_here):
    """The fetch's gather (on CUDA from the pinned store, in place): K and V rows at the selected positions
    of each head, from a batch-row slice of the store into a slice of the fetched set."""
    gen = torch.Generator().manual_seed(3)
    store_k, store_v = torch.randn(3, 2, 90, 40, generator=gen), torch.randn(3, 2, 90, 40, generator=gen)
    idx = torch.randint(0, 90, (2, 2, 70), generator=gen)
    fk, fv = torch.zeros(3, 2, 80, 40, device=DEVICE), torch.zeros(3, 2, 80, 40, device=DEVICE)
    src_k, src_v = as_store(store_k), as_store(store_v)
    assert triton_guide.gather_rows(src_k[1:], src_v[1:], idx.to(DEVICE), fk[1:, :, :70], fv[1:, :, :70])
    fk, fv = fk.cpu(), fv.cpu()
    want = idx[..., None].expand(-1, -1, -1, 40)
    assert torch.equal(fk[1:, :, :70], torch.gather(store_k[1:], 2, want))
    assert torch.equal(fv[1:, :, :70], torch.gather(store_v[1:], 2, want))
    assert not fk[0].any() and not fk[:, :, 70:].any()  # nothing else written
    assert not triton_guide.FAILED


def test_cpu_tensors_are_not_handed_to_a_compiled_gather(monkeypatch):
    """Outside the interpreter a compiled kernel cannot read CPU tensors: the gather does not apply (the caller
    gathers otherwise) and is not switched off."""
    monkeypatch.setattr(triton_guide, "FAILED", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = torch.zeros(1, 1, 4, 8)
    assert not triton_guide.gather_applies(t, t, torch.zeros(1, 1, 2, dtype=torch.long), t[:, :, :2], t[:, :, :2])
    assert not triton_guide.gather_rows(t, t, torch.zeros(1, 1, 2, dtype=torch.long), t[:, :, :2], t[:, :, :2])
    assert not triton_guide.FAILED


def test_triton_gather_of_the_missing_slots_keeps_the_others(gather_here):
    """The corrected set's gather in a recorded pass (host_memory.corrected_rows_fixed from a pinned store): only
    the slots asked for are read from the store and written; the others keep the rows the prefetch brought;
    the result equals the torch path's (the same function without the kernel)."""
    from engine.kvcache import host_memory

    gen = torch.Generator().manual_seed(4)
    store_k, store_v = torch.randn(2, 2, 90, 40, generator=gen), torch.randn(2, 2, 90, 40, generator=gen)
    only = torch.rand(2, 2, 16, generator=gen) < 0.4
    idx = torch.randint(0, 90, (2, 2, 16), generator=gen)
    fk, fv = torch.full((2, 2, 16, 40), 7.0, device=DEVICE), torch.full((2, 2, 16, 40), -7.0, device=DEVICE)
    src_k, src_v = as_store(store_k), as_store(store_v)
    assert triton_guide.gather_rows(src_k, src_v, idx.to(DEVICE), fk, fv, only=only.to(DEVICE))
    fk, fv = fk.cpu(), fv.cpu()
    want = torch.gather(store_k, 2, idx[..., None].expand(-1, -1, -1, 40))
    assert torch.equal(fk[only], want[only]) and (fk[~only] == 7.0).all() and (fv[~only] == -7.0).all()
    # corrected_rows_fixed: the prefetched positions old_idx (some invalid) reused, the rest from the store
    pick = torch.rand(2, 2, 16, generator=gen) < 0.5
    old_idx = torch.where(pick, idx, torch.randint(0, 90, (2, 2, 16), generator=gen))
    old_idx = old_idx[..., torch.randperm(16, generator=gen)]
    old_valid = torch.rand(2, 2, 16, generator=gen) < 0.8
    old_k = torch.gather(store_k, 2, old_idx[..., None].expand(-1, -1, -1, 40))
    old_v = torch.gather(store_v, 2, old_idx[..., None].expand(-1, -1, -1, 40))
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    want_v = torch.gather(store_v, 2, idx[..., None].expand(-1, -1, -1, 40))
    expect = ((idx[..., :, None] == old_idx[..., None, :]) & old_valid[..., None, :]).any(-1)
    for in_place in (True, False):  # the kernel's masked gather from the store, and the torch path
        k, v, reused = host_memory.corrected_rows_fixed(*on(old_k, old_v), src_k, src_v, *on(idx, old_idx, old_valid),
                                                     in_place=TritonCUDA().gather_rows if in_place else None)
        assert torch.equal(k.cpu(), want) and torch.equal(v.cpu(), want_v)
        assert torch.equal(reused.cpu(), expect) and expect.any() and (~expect).any()
    five = as_store(torch.full_like(store_k, 5.0))  # a store that differs: which slots came from where
    k, _, _ = host_memory.corrected_rows_fixed(*on(old_k, old_v), five, five, *on(idx, old_idx, old_valid),
                                            in_place=TritonCUDA().gather_rows)
    k = k.cpu()
    assert torch.equal(k[expect], want[expect]) and (k[~expect] == 5.0).all()
    assert not triton_guide.FAILED
