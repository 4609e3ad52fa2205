"""The decode step's native norms and ropes (engine/model/decode_norms.py, engine/native/norm_kernels.c): equal to
their torch references (the modules' own forward) to float rounding, declined where they do not apply, and taken
only on the fast decode path (a held model whose decode linears are not the exact kernel)."""
from __future__ import annotations

import pytest
import torch

from engine import native
from engine.model import decode_norms as dn
from engine.model.gemma import GemmaRMSNorm
from engine.model.linear_passes import prefill_pass
from engine.model.llama import apply_rope, rope_tables

pytestmark = pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")


def reference_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * scale


@pytest.mark.kernels
@pytest.mark.parametrize("rows,n", [(1, 640), (2, 256), (8, 100), (3, 17), (64, 1152)])
def test_rms_norm_equals_the_torch_formula(rows, n):
    g = torch.Generator().manual_seed(n)
    x, scale, res = torch.randn(rows, n, generator=g), torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    x[:, 3] *= 80  # an outlier channel, as Gemma's residual stream has
    want = reference_norm(x, scale, 1e-6)
    assert torch.allclose(dn.rms_norm(x, scale, 1e-6), want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(dn.rms_norm(x, scale, 1e-6, res=res), res + want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(dn.rms_norm(x, scale, 1e-6), torch.zeros_like(x))


@pytest.mark.kernels
@pytest.mark.parametrize("b,cs_b,t", [(1, 1, 1), (2, 2, 2), (3, 1, 2)])
@pytest.mark.parametrize("normed", [True, False])
def test_norm_rope_equals_the_modules_torch_path(b, cs_b, t, normed):
    heads, kv, d = 4, 1, 256
    g = torch.Generator().manual_seed(b * 10 + t)
    q, k = torch.randn(b, t, heads * d, generator=g), torch.randn(b, t, kv * d, generator=g)
    norm_q, norm_k = GemmaRMSNorm(d, 1e-6), GemmaRMSNorm(d, 1e-6)
    norm_q.weight.data.normal_(generator=g)
    norm_k.weight.data.normal_(generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    positions = torch.randint(0, 30000, (cs_b, t), generator=g)
    cos, sin = rope_tables(inv, 1.0, positions, torch.float32)
    want = []
    for y, norm in ((q, norm_q), (k, norm_k)):
        h = y.view(b, t, -1, d).transpose(1, 2)
        want.append(apply_rope(norm(h) if normed else h, cos, sin))
    parts = ((q, norm_q.scale() if normed else None), (k, norm_k.scale() if normed else None))
    assert dn.norm_rope(parts, d, 1e-6, cos, sin)
    for y, w in zip((q, k), want):
        assert torch.allclose(y.view(b, t, -1, d).transpose(1, 2), w, rtol=1e-5, atol=1e-5)


def test_the_native_calls_decline_what_they_cannot_read():
    x, scale = torch.randn(2, 64), torch.randn(64)
    assert dn.rms_norm(torch.randn(65, 64), scale, 1e-6) is None  # more rows than a decode step's
    assert dn.rms_norm(x.double(), scale, 1e-6) is None
    assert dn.rms_norm(torch.randn(64, 2).t(), scale, 1e-6) is None  # not contiguous
    assert dn.rms_norm(x, scale, 1e-6, res=torch.randn(3, 64)) is None
    with prefill_pass():  # prefill chunks keep the torch path
        assert dn.rms_norm(x, scale, 1e-6) is None
    cos, sin = rope_tables(torch.ones(32), 1.0, torch.arange(2)[None], torch.float32)
    q, k = torch.randn(1, 2, 128), torch.randn(1, 2, 64)
    before = q.clone()
    assert not dn.norm_rope(((q, None), (torch.randn(1, 64, 2).transpose(1, 2), None)), 64, 1e-6, cos, sin)
    assert not dn.norm_rope(((q, None), (torch.randn(1, 3, 64), None)), 64, 1e-6, cos, sin)  # T differs
    assert torch.equal(q, before)  # declined: nothing touched, not even the parts that would have been taken


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3"])  # phi3: engine.model.llama's classes, fused qkv
def test_the_fast_path_takes_them_and_stays_close_to_the_exact_one(tmp_path, monkeypatch, arch):
    """A held tiny GGUF: the default decode (int16 linears on x86, native norms and ropes) gives logits close to
    the exact path's, which takes none of the native norm calls; the norms alone move them by float rounding; a
    model not held takes none."""
    from engine.model.loading import load_model, prepare_model
    from tests.test_gemma_gguf import write_gemma_gguf

    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gemma_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    lm = load_model(str(path), device="cpu")
    calls = []
    real = dn.rms_norm
    monkeypatch.setattr(dn, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(5, 100, (1, 40), generator=torch.Generator().manual_seed(0))  # 40 rows: the native calls'
    logits = {}
    for kernel, norms in (("int16", None), ("exact", None), ("exact", True)):
        model = prepare_model(lm.model, decode_linear=kernel)
        assert all(m.native_decode == (kernel != "exact") for m in model.modules() if hasattr(m, "native_decode"))
        if norms is not None:
            dn.use_decode_norms(model, norms)
        model.set_attn_implementation("eager")  # (no cache: a plain forward)
        calls.clear()
        with torch.inference_mode():
            logits[kernel, norms] = model(input_ids=ids).logits
        assert bool(calls) == (kernel != "exact" or bool(norms))
    exact = logits["exact", None]

    def err(key):
        return ((logits[key] - exact).abs().max() / exact.abs().max()).item()

    assert 0 < err(("exact", True)) < 1e-4  # the native norms and ropes: float rounding
    assert 0 < err(("int16", None)) < 1e-2  # the int16 activations of random tiny weights: more
    dense = load_model(str(path), device="cpu", dtype="float32")  # de-quantized: not held
    assert not any(m.native_decode for m in dense.model.modules() if hasattr(m, "native_decode"))


@pytest.mark.slow
def test_the_embedded_llama_takes_the_native_norms_and_ropes_and_stays_close():
    """SmolLM2 (llama, held Q4_1 blocks): in the fast path every norm and rope of a 40-row forward is one native
    call, and its logits stay close to the exact path's."""
    from engine.model.loading import load_model, prepare_model

    lm = load_model(None, device="cpu")
    calls = {"rms_norm": 0, "norm_rope": 0}
    originals = {name: getattr(dn, name) for name in calls}

    def counted(name):
        def call(*a, **k):
            out = originals[name](*a, **k)
            calls[name] += out is not None and out is not False
            return out
        return call

    ids = torch.tensor([lm.tokenizer("The committee met on Tuesday to discuss the budget for the coming year.").input_ids])
    logits = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in calls:
            mp.setattr(dn, name, counted(name))
        for kernel in ("int16", "exact"):
            model = prepare_model(lm.model, decode_linear=kernel)
            model.set_attn_implementation("eager")
            before = dict(calls)
            with torch.inference_mode():
                logits[kernel] = model(input_ids=ids).logits
            layers = model.config.num_hidden_layers
            want = (2 * layers + 1, layers) if kernel != "exact" else (0, 0)
            assert (calls["rms_norm"] - before["rms_norm"], calls["norm_rope"] - before["norm_rope"]) == want
    prepare_model(lm.model)
    err = (logits["int16"] - logits["exact"]).abs().max() / logits["exact"].abs().max()
    assert 0 < err < 1e-3
    assert torch.equal(logits["int16"][0].argmax(-1), logits["exact"][0].argmax(-1))
