"""The native decode paths (engine/native): the skinny linear and the fused decode attention
must agree with the torch code they replace (the torch fallback, GuidedLayer.attend_decode)."""
from __future__ import annotations

import pytest
import torch

import engine.backends.native_fused
import engine.kvcache.fused
import engine.kvcache.guided
from engine import native
from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.generate.steps import greedy
from engine.kvcache import make_cache
from engine.model.held_weights import native_linear
from engine.model.linears import SkinnyLinear

needs_native = pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")


def prompts_of(lengths, vocab=320, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k", [192, 577])
def test_native_linear_matches_torch(rows, k):
    g = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(301, k, generator=g)
    b = torch.randn(301, generator=g)
    with torch.no_grad():
        for bias in (None, b):
            got = native_linear(x, w, bias)
            assert got is not None
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.kernels
@needs_native
def test_native_linear_declines_what_it_cannot_do():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    assert native_linear(x.double(), w.double(), None) is None  # not fp32
    assert native_linear(torch.randn(9, 64), w, None) is None  # more rows than the kernel takes
    assert native_linear(x, w.t().contiguous().t(), None) is None  # weight not contiguous
    with torch.enable_grad():
        assert native_linear(x.requires_grad_(), w, None) is None  # autograd wants torch


def test_skinny_linear_equals_linear_with_and_without_native(monkeypatch):
    lin = torch.nn.Linear(96, 40)
    skinny = torch.nn.Linear(96, 40)
    skinny.load_state_dict(lin.state_dict())
    skinny.__class__ = SkinnyLinear
    x = torch.randn(2, 3, 96)  # 6 rows: the skinny path
    with torch.no_grad():
        torch.testing.assert_close(skinny(x), lin(x), rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(native, "lib", lambda: None)
        torch.testing.assert_close(skinny(x), lin(x), rtol=1e-5, atol=1e-5)


def counting_fused(monkeypatch) -> list[int]:
    """Count the fused native calls (to show the test exercised them)."""
    calls = [0]
    original = engine.backends.native_fused.FusedDecode.__call__

    def wrapped(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(engine.backends.native_fused.FusedDecode, "__call__", wrapped)
    return calls


def forced_and_guides(engine_, prompt, forced) -> tuple[torch.Tensor, list[int]]:
    """Teacher-forced logits [steps, vocab] and, per step, a fingerprint of every layer's guide codes
    as that step's pass read them."""
    caches, prints, out = [], [], []
    new_cache = engine_.new_cache

    def keep(*args, **kwargs):
        caches.append(new_cache(*args, **kwargs))
        return caches[-1]

    engine_.new_cache = keep
    for logits in engine_.teacher_forced(prompt, forced):
        out.append(logits)
        guides = [layer.guide for layer in caches[0].layers if getattr(layer, "guide", None) is not None]
        prints.append(hash(b"".join(t.numpy().tobytes() for g in guides for t in (g.keys.codes, g.values.codes))))
    return torch.stack(out), prints


CONFIGS = [CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64),
           CacheConfig(mode="specache", k=8, bits=1, group=32, residual=16, sinks=0, chunk_size=64),
           CacheConfig(mode="kivi", group=32, residual=16, sinks=4, chunk_size=64),
           CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, select_both=True),
           CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current"),
           CacheConfig(mode="specache", k=8, bits=1, group=32, residual=16, sinks=4, chunk_size=64, rotation="hadamard"),
           CacheConfig(mode="kivi", bits=1, group=32, residual=16, sinks=0, chunk_size=64, rotation="hadamard"),
           CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current",
                       rotation="hadamard"),
           CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, correct=False),
           CacheConfig(mode="specache", k=8, bits=1, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current",
                       rotation="hadamard", outliers=4),
           CacheConfig(mode="specache", k=8, bits=1, group=32, residual=16, sinks=4, chunk_size=64, outliers=3),
           CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, store_dtype="fp32"),
           CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current",
                       store_dtype="fp32")]


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("config", CONFIGS, ids=["specache-2b", "specache-1b", "kivi", "select-both", "current",
                                                 "specache-1b-hadamard", "kivi-1b-hadamard", "current-hadamard",
                                                 "speculative-uncorrected", "current-1b-hadamard-outliers",
                                                 "specache-1b-outliers", "specache-fp32-store", "current-fp32-store"])
def test_fused_decode_equals_torch_path(tiny_model, monkeypatch, config):
    (prompt,) = prompts_of((300,))
    forced = prompts_of((40,), seed=9)[0]  # forced tokens cross quantization boundaries as they go
    calls = counting_fused(monkeypatch)
    fused, fused_guides = forced_and_guides(Engine(tiny_model, config), prompt, forced)
    assert calls[0] > 0, "the fused path did not run"
    layer = Engine(tiny_model, config).new_cache(1, 64).layers[0]
    assert layer.store.k.dtype == {None: torch.bfloat16, "fp32": torch.float32}[config.store_dtype]
    monkeypatch.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
    plain, plain_guides = forced_and_guides(Engine(tiny_model, config), prompt, forced)
    assert fused.shape == (len(forced), tiny_model.config.vocab_size)
    # The two paths' outputs differ by float rounding, and so do the K/V of the tokens after them: a
    # value that sits on a quantization step can then take the next code in one run (seen with the
    # x86-64-v4 build at step 37), and from there the runs read different guides. Compare the steps
    # whose passes read the same guide codes; the first quantization boundary comes at step 4.
    same = next((i for i, (a, b) in enumerate(zip(fused_guides, plain_guides)) if a != b), len(forced))
    assert same >= 30, f"the guides parted at step {same}"
    torch.testing.assert_close(fused[:same], plain[:same], rtol=1e-4, atol=1e-4)


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[5], CONFIGS[4], CONFIGS[9]],
                         ids=["specache-2b", "specache-1b-hadamard", "current", "current-1b-hadamard-outliers"])
def test_fused_decode_of_softcapped_layers_equals_torch_path(monkeypatch, config):
    """A softcapped model (Gemma 2's attention-logit softcapping, here a cap of 4 that bends most scores)
    decodes its guided layers by the native call, which caps every score as the torch path does. (Not
    specache-1b here: on this model its plain guide ties two candidates at step 13 with or without the cap,
    and the two paths break the tie differently, which the kernel check allows.)"""
    from engine.model.loading import prepare_model
    from tests.tiny_archs import VOCAB, tiny_model as arch_model

    model = prepare_model(arch_model("gemma2"))
    assert model.config.attn_logit_softcapping == 4.0
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB - 3, (300,), generator=g).tolist()
    forced = torch.randint(3, VOCAB - 3, (40,), generator=g).tolist()
    caps = []
    original = engine.backends.native_fused.FusedDecode.__call__

    def wrapped(self, qg, scaling, step, softcap=None):
        caps.append(softcap)
        return original(self, qg, scaling, step, softcap)

    monkeypatch.setattr(engine.backends.native_fused.FusedDecode, "__call__", wrapped)
    fused, fused_guides = forced_and_guides(Engine(model, config), prompt, forced)
    assert caps and set(caps) == {4.0}, "the softcapped layers did not take the native call"
    monkeypatch.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
    plain, plain_guides = forced_and_guides(Engine(model, config), prompt, forced)
    same = next((i for i, (a, b) in enumerate(zip(fused_guides, plain_guides)) if a != b), len(forced))
    assert same >= 30, f"the guides parted at step {same}"
    torch.testing.assert_close(fused[:same], plain[:same], rtol=1e-4, atol=1e-4)
    # and the cap matters: the same native call without it gives other logits
    monkeypatch.setattr(engine.kvcache.guided, "fused_applies", engine.kvcache.fused.fused_applies)
    monkeypatch.setattr(engine.backends.native_fused.FusedDecode, "__call__",
                        lambda self, qg, scaling, step, softcap=None: original(self, qg, scaling, step, None))
    uncapped, _ = forced_and_guides(Engine(model, config), prompt, forced)
    assert (uncapped[:same] - plain[:same]).abs().max() > 1e-3  # ten times the tolerance above


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=["speculative", "current"])
def test_fused_batch_of_different_lengths_equals_torch_path(tiny_model, monkeypatch, config):
    prompts = prompts_of((150, 97, 260))
    gen = GenerationConfig(max_tokens=24)
    fused = next(e for e in Engine(tiny_model, config).generate(prompts, gen) if isinstance(e, Finished))
    monkeypatch.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
    plain = next(e for e in Engine(tiny_model, config).generate(prompts, gen) if isinstance(e, Finished))
    assert fused.tokens == plain.tokens


@needs_native
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=["speculative", "current"])
def test_fused_results_do_not_depend_on_the_thread_count(tiny_model, monkeypatch, config):
    """Each (row, head) item of a pass runs whole in one thread: the logits are the same floats for
    1, 2 and 3 threads (2 KV heads: 3 threads leave one idle, 2 give one item each)."""
    (prompt,) = prompts_of((1200,))
    forced = prompts_of((12,), seed=9)[0]
    runs = {}
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "_threads", threads)
        runs[threads] = torch.stack(list(Engine(tiny_model, config).teacher_forced(prompt, forced)))
    assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3])


@pytest.mark.kernels
@needs_native
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=["speculative", "current"])
def test_fused_fetched_buffers_hold_the_exact_rows_of_the_selection(tiny_model, config):
    """The fused path copies only newly selected rows into freed slots: every valid slot must still
    hold the host store's exact K/V at its position, and the positions must be distinct. With
    prefetch current it reads the selected rows from the store itself (nothing to copy on a
    CPU): the selection must still be k distinct positions of the guide region."""
    from engine.generate.steps import decoder_for, prefill

    (prompt,) = prompts_of((280,))
    cache = make_cache(tiny_model.config, config, 1, 400, torch.float32, tiny_model.device)
    *_, last = prefill(tiny_model, cache, prompt, 0, config.chunk_size)
    steps = decoder_for(cache)(tiny_model, cache, last[None], greedy)
    for _ in range(30):
        next(steps)
    checked = 0
    for layer in cache.layers:
        assert layer.fused is not None
        valid = layer.fvalid[0]  # [H_kv, k]
        for h in range(valid.shape[0]):
            pos = layer.fidx[0, h][valid[h]]
            assert len(set(pos.tolist())) == len(pos)
            assert bool((pos >= config.sinks).all()) and bool((pos < layer.qend[0]).all())
            if config.prefetch == "current":
                assert len(pos) == min(config.k, int(layer.qend[0]) - config.sinks)
                checked += len(pos)
                continue
            # (a 16-bit store's rows widened: exactly its values)
            torch.testing.assert_close(layer.store.fk[0, h][valid[h]], layer.store.k[0, h, pos].float(), rtol=0, atol=0)
            torch.testing.assert_close(layer.store.fv[0, h][valid[h]], layer.store.v[0, h, pos].float(), rtol=0, atol=0)
            checked += len(pos)
    assert checked > 0


@pytest.mark.skipif(native.lib() is None, reason="native library not built")
def test_a_policy_that_overrides_a_hook_of_the_pass_runs_the_torch_code(tiny_model, monkeypatch):
    """The native call reproduces GuidedLayer's and SpecacheLayer's hooks only: a policy built on them
    that overrides one (here its own choice of the fetched set) decodes by the torch code, its hook
    called; one that overrides none keeps the native call."""
    import engine.kvcache
    from engine.kvcache.fused import hooks_reproduced
    from engine.kvcache.policies.specache import SpecacheLayer

    calls = []

    class OwnChoice(SpecacheLayer):
        def select_current(self, scores, rscores, step, nq, qend):
            calls.append(nq)
            super().select_current(scores, rscores, step, nq, qend)

    class Unchanged(SpecacheLayer):
        pass

    assert hooks_reproduced(SpecacheLayer) and hooks_reproduced(Unchanged) and not hooks_reproduced(OwnChoice)
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current")
    prompt = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    for cls in (Unchanged, OwnChoice):  # the run's policy class, passed as the run passes it
        built = []
        monkeypatch.setattr(engine.kvcache.guided, "fused_decode", lambda layer: built.append(layer) or
                            engine.backends.native_fused.FusedDecode(layer))
        run = next(e for e in Engine(tiny_model, config, cls=cls).generate([prompt], GenerationConfig(max_tokens=4))
                   if isinstance(e, Finished))
        assert len(run.tokens[0]) == 4
        assert (len(built) > 0) == (cls is Unchanged)
        said = run.cache_stats.get("fused_decode")  # the run says why the torch code ran
        assert (said is None) if cls is Unchanged else said == "torch: OwnChoice overrides select_current"
    assert calls  # the override ran, on every decode pass of every layer
