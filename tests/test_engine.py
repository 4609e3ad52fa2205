"""The engine's exactness limits and invariants, on tiny random GQA Llama models.

- k >= context: every position is exact, so greedy tokens equal transformers' DynamicCache.
- k = 0 (kivi): logits equal a straightforward KIVI reference (dequantize, then attention).
- batching, chunk size and sampling seeds do not change results."""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.generate.steps import forward, prefill
from engine.kvcache import make_cache
from engine.kvcache.sizes import quant_boundary
from engine.kvcache.rotation import rotation_matrix
from tests.conftest import kivi_guide_part

NEW = 24


def prompts_of(lengths, vocab=320, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def dynamic_cache_greedy(model, prompt, n=NEW):
    """transformers' own generate with DynamicCache and SDPA attention."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    finally:
        model.set_attn_implementation(impl)
    return out[0, len(prompt):].tolist()


def run(model, prompts, config, gen=GenerationConfig(max_tokens=NEW)):
    return next(e for e in Engine(model, config).generate(prompts, gen) if isinstance(e, Finished))


@pytest.fixture(scope="module")
def reference(tiny_model):
    ps = prompts_of((150, 97, 260))
    return ps, [dynamic_cache_greedy(tiny_model, p) for p in ps]


def test_a_prefill_computes_the_logits_of_its_last_chunk_only(tiny_model):
    """The chunks before the last ask the lm_head for no position (an empty index, as transformers reads
    logits_to_keep): Gemma 3's 262144-row lm_head was a quarter of its prefill. The last chunk's last
    logits come out as before: those of one pass over the whole prompt, to float rounding."""
    (p,) = prompts_of((150,))
    seen = []
    hook = tiny_model.lm_head.register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape)))
    try:
        parts = {}
        for chunk in (64, 256):
            cache = make_cache(tiny_model.config, CacheConfig(mode="full", chunk_size=chunk), 1, 160, torch.float32,
                               torch.device("cpu"))
            *done, parts[chunk] = prefill(tiny_model, cache, p, 0, chunk)
            assert done == [min(s + chunk, 150) for s in range(0, 150, chunk)]
    finally:
        hook.remove()
    v = tiny_model.config.vocab_size
    assert seen == [(1, 0, v), (1, 0, v), (1, 1, v), (1, 1, v)]  # chunks of 64: 64, 64, 22; then one chunk
    torch.testing.assert_close(parts[64], parts[256], rtol=1e-4, atol=1e-4)


def test_reference_is_not_trivial(reference):
    _, refs = reference
    assert all(len(set(r)) > 3 for r in refs), "the random model should not emit one token over and over"


def test_full_cache_equals_dynamic_cache(tiny_model, reference):
    ps, refs = reference
    res = run(tiny_model, ps, CacheConfig(mode="full", chunk_size=64))
    assert res.tokens == refs


@pytest.mark.parametrize("bits,group,chunk,rotation,outliers", [(2, 32, 64, "none", 0), (1, 64, 512, "none", 0),
                                                              (2, 64, 16, "none", 0), (1, 32, 64, "hadamard", 0),
                                                              (1, 128, 64, "hadamard", 4)])
def test_specache_with_k_at_least_context_equals_dynamic_cache(tiny_model, reference, bits, group, chunk, rotation,
                                                               outliers):
    ps, refs = reference
    config = CacheConfig(mode="specache", k=4096, bits=bits, group=group, residual=16, sinks=4, chunk_size=chunk,
                         rotation=rotation, outliers=outliers, store_dtype="fp32")  # exact relative to the store
    assert run(tiny_model, ps[:1], config).tokens == refs[:1]
    assert run(tiny_model, ps, config).tokens == refs  # batch of different lengths


def test_window_covering_the_context_equals_full(tiny_model, reference):
    ps, refs = reference
    config = CacheConfig(mode="window", window=1024, sinks=4, chunk_size=64)
    assert run(tiny_model, ps, config).tokens == refs


def test_small_k_changes_output_but_batch_equals_single(tiny_model, reference):
    ps, refs = reference
    config = CacheConfig(mode="specache", k=8, bits=1, group=32, residual=16, sinks=2, chunk_size=64)
    batched = run(tiny_model, ps, config).tokens
    singles = [run(tiny_model, [p], config).tokens[0] for p in ps]
    assert batched == singles
    assert batched != refs, "1-bit guide with k=8 should not be exact on this model"


@pytest.mark.parametrize("store, tol", [("fp32", 1e-4), ("bf16", 3e-3)])
def test_chunk_size_does_not_change_prefill(tiny_model, store, tol):
    """With an exact store in the compute dtype, to float rounding; with a 16-bit store (the CPU's default) a
    chunk reads the earlier chunks' K/V rounded to it, so smaller chunks differ by that rounding."""
    (p,) = prompts_of((300,))
    for mode in ("full", "specache"):
        outs = []
        for chunk in (16, 100, 512):
            config = CacheConfig(mode=mode, chunk_size=chunk, group=32, residual=16, store_dtype=store)
            cache = make_cache(tiny_model.config, config, 1, 400, torch.float32, tiny_model.device)
            *_, logits = prefill(tiny_model, cache, p, 0, chunk)
            outs.append(logits)
        for other in outs[1:]:
            torch.testing.assert_close(other, outs[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["full", "specache", "window"])
def test_prefill_mask_is_built_once_per_chunk_and_equals_the_boolean_one(tiny_model, monkeypatch, mode):
    """Off the CPU split path, the layers of a pass share one additive mask (0 / -inf); each layer
    used to build a boolean one that attention converted again. Same logits as attention with the
    boolean mask, and as the CPU's split attention (past unmasked + causal block, merged by
    log-sum-exp), which builds no mask at all."""
    import engine.kvcache.base
    import engine.kvcache.policies.full
    import engine.kvcache.guided
    from engine.kvcache.base import additive_mask

    allowed = torch.tensor([[True, False], [True, True]])
    assert additive_mask(None, torch.float32) is None
    assert torch.equal(additive_mask(allowed, torch.float32), torch.tensor([[0.0, float("-inf")], [0.0, 0.0]]))
    (p,) = prompts_of((200,))
    config = CacheConfig(mode=mode, chunk_size=64, group=32, residual=16, window=40)
    built = []

    def prefill_logits():
        cache = make_cache(tiny_model.config, config, 1, 300, torch.float32, tiny_model.device)
        *_, logits = prefill(tiny_model, cache, p, 0, 64)
        return logits

    for module in (engine.kvcache.guided, engine.kvcache.policies.full):
        monkeypatch.setattr(module, "additive_mask", lambda a, dtype: built.append(1) or additive_mask(a, dtype))
    split = prefill_logits()
    assert len(built) == (0 if tiny_model.device.type == "cpu" else 4)  # (no split path off the CPU)
    built.clear()
    for module in (engine.kvcache.guided, engine.kvcache.policies.full):
        monkeypatch.setattr(module, "split_attention_applies", lambda q, step: False)
    shared = prefill_logits()
    assert len(built) == 4  # 4 chunks, 3 layers each
    monkeypatch.setattr(engine.kvcache.guided, "additive_mask", lambda a, dtype: a)  # boolean masks, as before
    monkeypatch.setattr(engine.kvcache.base, "additive_mask", lambda a, dtype: a)
    monkeypatch.setattr(engine.kvcache.policies.full, "additive_mask", lambda a, dtype: a)
    boolean = prefill_logits()
    torch.testing.assert_close(shared, boolean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, boolean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_prefill_attention_equals_masked_sdpa(parts):
    """The chunk's attention as past pieces (unmasked) + its causal block merged by log-sum-exp
    equals one SDPA over [past, chunk] with the causal mask and K/V repeated per query head."""
    from engine.kvcache.base import split_prefill_attention, ungroup_output

    g = torch.Generator().manual_seed(parts)
    b, h, hk, t, d = 1, 6, 2, 37, 32
    sizes = [0, 50, 13][:parts]
    q = torch.randn(b, h, t, d, generator=g) * 3
    k = torch.randn(b, hk, sum(sizes) + t, d, generator=g)
    v = torch.randn(b, hk, sum(sizes) + t, d, generator=g)
    past, at = [], 0
    for n in sizes:
        past.append((k[:, :, at : at + n], v[:, :, at : at + n]))
        at += n
    out = ungroup_output(split_prefill_attention(q, past, k[:, :, at:], v[:, :, at:], 0.2), h, t)
    n = at + t
    allowed = torch.arange(n)[None, :] <= at + torch.arange(t)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(h // hk, 1),
                                                           v.repeat_interleave(h // hk, 1), attn_mask=allowed, scale=0.2)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded(tiny_model):
    (p,) = prompts_of((120,))
    config = CacheConfig(mode="specache", k=16, group=32, residual=16)
    a = run(tiny_model, [p], config, GenerationConfig(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)).tokens
    b = run(tiny_model, [p], config, GenerationConfig(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)).tokens
    c = run(tiny_model, [p], config, GenerationConfig(max_tokens=20, temperature=1.0, top_p=0.9, seed=8)).tokens
    assert a == b
    assert a != c


def test_device_bytes_shrink_and_host_holds_everything(tiny_model):
    (p,) = prompts_of((1000,))
    full = run(tiny_model, [p], CacheConfig(mode="full"), GenerationConfig(max_tokens=4)).cache_stats
    spec = run(tiny_model, [p], CacheConfig(mode="specache", bits=1, group=64, k=32, residual=64),
               GenerationConfig(max_tokens=4)).cache_stats
    assert spec["device_bytes"] < 0.5 * full["device_bytes"]
    assert 2 * spec["host_bytes"] == full["device_bytes"]  # every token exact in the host store (bf16 of fp32 here)


# ---- k = 0: KIVI with the same residual window, against a reference written here ----------

class KiviReference:
    """Plain KIVI: exact K/V kept per layer; at each decode step positions below the quantization
    boundary are replaced by dequantize(quantize(.)), sinks stay exact, then ordinary attention."""

    def __init__(self, bits, group, residual, sinks, rotation=None, outliers=0, chosen_from=0):
        self.bits, self.group, self.residual, self.sinks = bits, group, residual, sinks
        self.rotation = rotation  # R [D, D]: KIVI of K R and V R, rotated back (engine/kvcache/rotation.py)
        # outlier key channels (conftest.outlier_keys_reference), chosen from the first chosen_from positions
        self.outliers, self.chosen_from = outliers, chosen_from
        self.k, self.v = {}, {}
        self.length = 0

    def attention(self, module, q, k, v, mask, scaling=None, **kwargs):
        i = module.layer_idx
        if i in self.k:
            self.k[i] = torch.cat([self.k[i], k], dim=2)
            self.v[i] = torch.cat([self.v[i], v], dim=2)
        else:
            self.k[i], self.v[i] = k, v
        keys, values = self.k[i], self.v[i]
        t = q.shape[2]
        qend = int(quant_boundary(torch.tensor(self.length), self.residual, self.group)) if t == 1 else 0
        if qend:
            keys, values = kivi_guide_part(keys, values, qend, self.bits, self.group, self.group, self.sinks,
                                           self.rotation, self.outliers, self.chosen_from)
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=t > 1, scale=scaling)
        return out.transpose(1, 2), None


@pytest.mark.parametrize("bits,sinks,rotation,outliers", [(2, 0, "none", 0), (1, 4, "none", 0), (1, 4, "hadamard", 0),
                                                   (2, 0, "hadamard", 0), (1, 4, "hadamard", 4), (2, 0, "none", 2)])
def test_kivi_mode_equals_reference_kivi(tiny_model, bits, sinks, rotation, outliers):
    (p,) = prompts_of((230,))
    group, residual, steps = 32, 16, 40
    config = CacheConfig(mode="kivi", bits=bits, group=group, residual=residual, sinks=sinks, chunk_size=64,
                         rotation=rotation, outliers=outliers, store_dtype="fp32")  # (prefill reads the store)
    cache = make_cache(tiny_model.config, config, 1, 400, torch.float32, tiny_model.device)
    *_, logits = prefill(tiny_model, cache, p, 0, 64)

    dev = tiny_model.device
    chosen_from = int(quant_boundary(torch.tensor(64), residual, group))  # the first prefill chunk's quantized keys
    r = rotation_matrix(rotation, tiny_model.config.head_dim)
    ref = KiviReference(bits, group, residual, sinks, None if r is None else r.to(tiny_model.device),
                        outliers, chosen_from)
    AttentionInterface.register("kivi_reference", ref.attention)
    impl = tiny_model.config._attn_implementation
    tiny_model.set_attn_implementation("kivi_reference")
    try:
        with torch.inference_mode():
            ids = torch.tensor([p], device=dev)
            positions = torch.arange(len(p), device=dev)[None]
            ref_logits = tiny_model(ids, position_ids=positions, use_cache=False).logits[0, -1]
            ref.length = len(p)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            token = int(ref_logits.argmax())
            crossed = 0
            for step in range(steps):
                pos = torch.tensor([[ref.length]], device=dev)
                ref_logits = tiny_model(torch.tensor([[token]], device=dev), position_ids=pos, use_cache=False).logits[0, -1]
                tiny_model.set_attn_implementation(impl)
                ours = forward(tiny_model, cache, torch.tensor([[token]], device=dev), slice(0, 1))[0, -1]
                tiny_model.set_attn_implementation("kivi_reference")
                torch.testing.assert_close(ours, ref_logits, rtol=1e-3, atol=1e-3)
                crossed += int(quant_boundary(torch.tensor(ref.length + 1), residual, group)) != \
                    int(quant_boundary(torch.tensor(ref.length), residual, group))
                ref.length += 1
                token = int(ref_logits.argmax())
            assert crossed >= 1, "the test should cross a quantization boundary during decoding"
    finally:
        tiny_model.set_attn_implementation(impl)


def test_teacher_forced_full_and_exact_specache_agree(tiny_model, reference):
    ps, refs = reference
    full = torch.stack(list(Engine(tiny_model, CacheConfig(mode="full")).teacher_forced(ps[0], refs[0])))
    spec = torch.stack(list(Engine(tiny_model, CacheConfig(mode="specache", k=4096, group=32, residual=16,
                                                           store_dtype="fp32")).teacher_forced(ps[0], refs[0])))
    assert full.shape == (len(refs[0]), tiny_model.config.vocab_size)
    assert full.argmax(-1).tolist() == refs[0]  # greedy reference: forced tokens are the argmax
    torch.testing.assert_close(spec, full, rtol=1e-3, atol=1e-3)


def test_prefetch_hit_rate(tiny_model):
    (p,) = prompts_of((400,))
    gen = GenerationConfig(max_tokens=12)
    everything = run(tiny_model, [p], CacheConfig(mode="specache", k=4096, group=32, residual=16,
                                                  measure_hits=True), gen).cache_stats
    assert everything["prefetch_hit_rate"] == 1.0
    few = run(tiny_model, [p], CacheConfig(mode="specache", k=8, bits=1, group=32, residual=16,
                                           measure_hits=True), gen).cache_stats
    assert 0.0 <= few["prefetch_hit_rate"] < 1.0
    assert "prefetch_hit_rate" not in run(tiny_model, [p], CacheConfig(mode="specache", k=8, group=32), gen).cache_stats


@pytest.mark.parametrize("mode", ["full", "specache", "kivi"])
def test_shared_prefix_batch_equals_separate_runs(tiny_model, mode):
    (doc,) = prompts_of((260,), seed=5)
    questions = prompts_of((7, 12, 9), seed=6)
    prompts = [doc + q for q in questions]
    config = CacheConfig(mode=mode, k=16, group=32, residual=16, chunk_size=64)
    gen = GenerationConfig(max_tokens=16)
    shared = next(e for e in Engine(tiny_model, config).generate(prompts, gen, shared_prefix=len(doc))
                  if isinstance(e, Finished))
    separate = [run(tiny_model, [p], config, gen).tokens[0] for p in prompts]
    assert shared.tokens == separate


def test_resync_after_a_missed_speculation_uses_prompt_lookup():
    from engine.generate.steps import _follow_table, _resync

    prompt = [10, 11, 12, 10, 13]
    assert _follow_table(prompt) == {10: 13, 11: 12, 12: 10}  # the latest occurrence wins
    follow, prev = [_follow_table(prompt), _follow_table(prompt)], [13, 13]
    current = torch.tensor([20, 20])  # T_t, committed by this step
    fed = torch.tensor([21, 10])  # the guesses fed for T_{t+1}
    out = torch.tensor([10, 10])  # T_{t+1}: row 0 missed, row 1 guessed right
    spec = torch.tensor([99, 98])  # the model's next guesses
    got, ids = _resync(follow, prev, current, out, fed, spec)
    assert got.tolist() == [13, 98]  # row 0: what followed the latest 10; row 1 keeps the model's guess
    assert ids == [10, 10]  # the output tokens, read on the host in the same read
    assert follow[0][13] == 20 and prev == [20, 20]  # the committed token joined the history
    # a repeated token: its latest occurrence is the token just committed
    assert _resync([{}], [None], torch.tensor([7]), torch.tensor([7]), torch.tensor([8]), torch.tensor([1]))[0].tolist() == [7]
    # nothing to look up: the model's guess stays
    assert _resync([{}], [None], torch.tensor([7]), torch.tensor([5]), torch.tensor([8]), torch.tensor([1]))[0].tolist() == [1]


def test_resync_keeps_the_exactness_limit(tiny_model, reference):
    """Re-syncing changes which positions are fetched, never correctness: with k >= context the
    output still equals DynamicCache's, with and without it (and with and without the correction)."""
    ps, refs = reference
    for resync, correct in ((True, True), (False, True), (True, False)):
        config = CacheConfig(mode="specache", k=4096, group=32, residual=16, resync=resync, correct=correct,
                             store_dtype="fp32")
        assert run(tiny_model, ps, config).tokens == refs


@pytest.mark.parametrize("fused", [True, False])
def test_corrected_speculation_attends_with_the_output_tokens_own_set(tiny_model, monkeypatch, fused):
    """The speculative decoder with the correction: the output token ranks the guide itself before it
    attends, so its logits are those of prefetch current (the speculative token in the same pass
    is after it, which it never sees), while the set the guess prefetched is what the step reuses
    (the share reported as prefetch_reuse). Without the correction the logits differ."""
    import engine.kvcache.guided

    if not fused:
        monkeypatch.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
    (prompt,) = prompts_of((300,))
    forced = prompts_of((40,), seed=9)[0]
    base = dict(mode="specache", k=8, bits=1, group=32, residual=16, sinks=2, chunk_size=64)

    def forced_logits(**kw):
        return torch.stack(list(Engine(tiny_model, CacheConfig(**base, **kw)).teacher_forced(prompt, forced)))

    current = forced_logits(prefetch="current")
    torch.testing.assert_close(forced_logits(prefetch="speculative", correct=True), current, rtol=1e-4, atol=1e-4)
    assert (forced_logits(prefetch="speculative", correct=False) - current).abs().max() > 1e-2
    stats = run(tiny_model, [prompt], CacheConfig(**base, correct=True)).cache_stats
    assert stats["correct"] is True and 0 < stats["prefetch_reuse"] < 1
    assert "prefetch_reuse" not in run(tiny_model, [prompt], CacheConfig(**base, correct=False)).cache_stats


def test_corrected_rows_reuse_the_prefetched_rows_and_fetch_the_rest():
    """HostStore.correct's merge: rows at the new positions, those the prefetch held taken from the
    fetched rows (not the host: poisoned there), the others from the host store."""
    from engine.kvcache.host_memory import corrected_rows

    g = torch.Generator().manual_seed(1)
    host_k, host_v = torch.randn(1, 1, 50, 4, generator=g), torch.randn(1, 1, 50, 4, generator=g)
    old_idx = torch.tensor([[[7, 3, 20, 0, 9]]])
    old_valid = torch.tensor([[[True, True, True, False, True]]])
    fk, fv = host_k[:, :, old_idx[0, 0]].clone(), host_v[:, :, old_idx[0, 0]].clone()
    idx = torch.tensor([[[20, 11, 7, 40, 9]]])
    poisoned_k, poisoned_v = host_k.clone(), host_v.clone()
    poisoned_k[:, :, [20, 7, 9]] = float("nan")  # held by the prefetch: must not be read from the host
    poisoned_v[:, :, [20, 7, 9]] = float("nan")
    k, v, reused = corrected_rows(fk, fv, poisoned_k, poisoned_v, idx, old_idx, old_valid)
    assert reused.tolist() == [[[True, False, True, False, True]]]
    torch.testing.assert_close(k, host_k[:, :, idx[0, 0]], rtol=0, atol=0)
    torch.testing.assert_close(v, host_v[:, :, idx[0, 0]], rtol=0, atol=0)


def test_current_prefetch_keeps_the_limits_and_steps_one_token_at_a_time(tiny_model, reference, monkeypatch):
    """prefetch "current": each pass picks its own fetched set, then attends. k >= context: the
    output equals DynamicCache's; k small: not exact, but batched equals single and it differs
    from the speculative decoder's output only through which positions were fetched."""
    import engine.generate.steps as decode

    ps, refs = reference
    exact = CacheConfig(mode="specache", k=4096, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current",
                        store_dtype="fp32")
    calls = []
    original = decode.forward
    monkeypatch.setattr(decode, "forward", lambda model, cache, ids, *a, **kw: calls.append(ids.shape[1]) or
                        original(model, cache, ids, *a, **kw))
    assert run(tiny_model, ps, exact).tokens == refs
    assert set(calls[-(NEW - 1):]) == {1}  # decode passes feed one token each
    small = CacheConfig(mode="specache", k=8, group=32, residual=16, sinks=2, chunk_size=64, prefetch="current")
    batched = run(tiny_model, ps, small).tokens
    assert batched == [run(tiny_model, [p], small).tokens[0] for p in ps]
    assert batched != refs


def test_current_prefetch_selects_the_guides_top_k(tiny_model):
    """After a pass with prefetch "current", the fetched set of each KV head is the top-k of that
    pass's own guide attention over [sinks, qend) (checked against a plain recomputation)."""
    from engine.kvcache.policies.specache import SpecacheLayer as GuidedLayer

    config = CacheConfig(mode="specache", k=8, group=32, residual=16, sinks=2, chunk_size=64, prefetch="current")
    (p,) = prompts_of((200,))
    cache = make_cache(tiny_model.config, config, 1, 260, torch.float32, tiny_model.device)
    *_, last = prefill(tiny_model, cache, p, 0, config.chunk_size)
    seen = {}
    original = GuidedLayer.select_current

    def spy(self, scores, rscores, step, nq, qend):
        probs = torch.softmax(torch.cat([scores, rscores], dim=-1), dim=-1)[..., :nq].sum(dim=2)  # [1, H_kv, nq]
        probs[..., : self.sinks] = -1
        seen[id(self)] = set(probs[0, 0].topk(self.topk).indices.tolist())
        return original(self, scores, rscores, step, nq, qend)

    import engine.kvcache.guided

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GuidedLayer, "select_current", spy)
        mp.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
        forward(tiny_model, cache, last.argmax(-1).view(1, 1), slice(0, 1))
    assert len(seen) == len(cache.layers)
    for layer in cache.layers:
        assert set(layer.fidx[0, 0][layer.fvalid[0, 0]].tolist()) == seen[id(layer)]


# ---- bf16: the limits against a bf16 DynamicCache, and the native bf16 prefill attention --------

@pytest.fixture(scope="module")
def tiny_bf16():
    """The tiny model in bf16 (weights, activations, K/V and the exact store), exact torch path."""
    from conftest import TEST_DEVICE, make_tiny_model

    from engine.model.loading import prepare_model

    return prepare_model(make_tiny_model().to(torch.bfloat16)).to(TEST_DEVICE)


@pytest.fixture(scope="module")
def reference_bf16(tiny_bf16):
    ps = prompts_of((150, 97, 260))
    return ps, [dynamic_cache_greedy(tiny_bf16, p) for p in ps]


def clear_steps(logits: torch.Tensor) -> torch.Tensor:
    """Steps [T] whose top logit leads the second by more than 5% (no near-tie that bf16 rounding flips)."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > 0.05 * top2[:, 0].abs()


def test_bf16_full_cache_equals_bf16_dynamic_cache(tiny_bf16, reference_bf16):
    """Prefilled in one pass, as DynamicCache is, the bf16 full cache gives its tokens exactly. Prefilled in
    chunks, a CPU without native bf16 (AVX2: torch emulates bf16 GEMMs, blocked by the row count) rounds
    the chunks' products differently, so the check is then teacher-forced: the forced token is the argmax
    at every step without a near-tie."""
    ps, refs = reference_bf16
    assert len({t for r in refs for t in r}) > 3  # (the bf16 random model repeats itself more than the fp32 one)
    assert run(tiny_bf16, ps, CacheConfig(mode="full", chunk_size=512)).tokens == refs
    checked = 0
    for p, ref in zip(ps, refs):
        full = torch.stack(list(Engine(tiny_bf16, CacheConfig(mode="full", chunk_size=64)).teacher_forced(p, ref)))
        clear = clear_steps(full.float())
        checked += int(clear.sum())
        assert full.float().argmax(-1)[clear].tolist() == torch.tensor(ref)[clear].tolist()
    assert checked >= sum(map(len, refs)) // 4  # (a check of most steps, not of none)


@pytest.mark.parametrize("bits,group,chunk,prefetch", [(2, 32, 64, "speculative"), (1, 64, 512, "current")])
def test_bf16_specache_with_k_at_least_context_equals_bf16_full_cache(tiny_bf16, reference_bf16, bits, group, chunk,
                                                                      prefetch):
    """In bf16 the guided decode path (scores and softmax in fp32 over bf16 K/V) rounds differently
    from SDPA in bf16, so greedy tokens of a random model drift apart after a few near-ties; the
    limit is checked teacher-forced instead: on the bf16 DynamicCache's own tokens, every step's
    logits of specache with k >= context equal the bf16 full cache's (which equals DynamicCache
    token for token, test above) within bf16 rounding, and the argmax is the forced token wherever
    there is no near-tie."""
    ps, refs = reference_bf16
    config = CacheConfig(mode="specache", k=4096, bits=bits, group=group, residual=16, sinks=4, chunk_size=chunk,
                         prefetch=prefetch)
    for p, ref in zip(ps, refs):
        full = torch.stack(list(Engine(tiny_bf16, CacheConfig(mode="full", chunk_size=chunk)).teacher_forced(p, ref)))
        spec = torch.stack(list(Engine(tiny_bf16, config).teacher_forced(p, ref)))
        full, spec = full.float(), spec.float()
        clear = clear_steps(full)
        assert full.argmax(-1)[clear].tolist() == torch.tensor(ref)[clear].tolist()  # (test above)
        torch.testing.assert_close(spec, full, rtol=0, atol=0.0125 * float(full.abs().max()))  # ~3 bf16 ulps of the largest
        assert spec.argmax(-1)[clear].tolist() == torch.tensor(ref)[clear].tolist()


def _native_attention_or_skip():
    from engine import native

    lib = native.lib()
    if lib is None or not lib.specache_prefill_attention_available():
        pytest.skip("no native library with AVX512-BF16 on this machine")


@pytest.mark.parametrize("t,d,sizes,dtype", [(37, 32, [0], torch.float32), (37, 32, [50, 13], torch.float32),
                                             (100, 64, [33, 7], torch.float32), (70, 64, [129], torch.bfloat16)])
def test_native_bf16_prefill_attention_is_close_to_the_exact_one(t, d, sizes, dtype):
    """The native kernel (Q, K, P, V in bf16, fp32 sums) against the exact split attention in fp32:
    within bf16 rounding, for any split of the past into pieces, a chunk longer than one query block
    (32), odd lengths, and bf16 K/V. A wrong causal edge or a lost piece is off by far more."""
    from engine.kvcache.base import native_prefill_attention, split_prefill_attention

    _native_attention_or_skip()
    g = torch.Generator().manual_seed(t)
    h, hk, start = 6, 2, sum(sizes)
    q = torch.randn(1, h, t, d, generator=g) * 2
    k = torch.randn(1, hk, start + t, d, generator=g).to(dtype)
    v = torch.randn(1, hk, start + t, d, generator=g).to(dtype)
    pieces, at = [], 0
    for n in sizes + [t]:  # each piece its own tensor (own strides), as the store and the residual buffer are
        pieces.append((k[:, :, at : at + n].clone(), v[:, :, at : at + n].clone()))
        at += n
    out = native_prefill_attention(q, pieces, 0.2, start)
    ref = split_prefill_attention(q, [(k[:, :, :start].float(), v[:, :, :start].float())], k[:, :, start:].float(),
                                  v[:, :, start:].float(), 0.2)
    assert out is not None and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=4e-2)
    assert (out - ref).abs().mean() < 4e-3
    # the same kernel with the chunk's block made visible to every query would be far off
    assert native_prefill_attention(q, pieces[:-1], 0.2, start) is None  # the pieces must hold every position


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("start,t,first,window", [(0, 70, 0, 0), (150, 37, 0, 0), (150, 37, 87, 64), (300, 100, 201, 100)])
def test_the_bf16_prefill_kernels_are_close_to_the_exact_attention(kernel, start, t, first, window, monkeypatch):
    """Both codes of a bf16 prefill chunk's attention (bf16_prefill_kernel: the native kernel, torch's flash kernel
    on bf16) against the exact fp32 one over the same keys and mask, causal and within a window, the pieces split
    anywhere: within bf16 rounding."""
    from engine.kvcache import passes

    if kernel == "native":
        _native_attention_or_skip()
    monkeypatch.setattr(passes, "bf16_prefill_kernel", lambda: kernel)
    g = torch.Generator().manual_seed(start + t)
    h, hk, d, n = 6, 2, 64, start + t - first
    q = torch.randn(1, h, t, d, generator=g) * 2
    k, v = torch.randn(1, hk, n, d, generator=g), torch.randn(1, hk, n, d, generator=g)
    cut = n // 3
    out = passes.bf16_prefill_attention(q, [(k[:, :, :cut], v[:, :, :cut]), (k[:, :, cut:], v[:, :, cut:])], 0.2,
                                        start, first, window)
    kpos, qpos = torch.arange(first, start + t), torch.arange(start, start + t)[:, None]
    allowed = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    ref = passes.grouped_query(torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1), attn_mask=allowed, scale=0.2), hk)
    assert out is not None and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=4e-2)
    assert (out - ref).abs().mean() < 4e-3


def test_native_bf16_prefill_keeps_specache_equal_to_full(tiny_model, reference):
    """With the native bf16 prefill attention (what --dtype auto takes on such a CPU) the prefill is no
    longer exact, but k >= context still makes specache equal to the full cache: both prefill
    through the same kernel and decode exactly."""
    from engine.model.loading import prepare_model

    _native_attention_or_skip()
    ps, _ = reference
    prepare_model(tiny_model, torch.bfloat16)
    try:
        full = run(tiny_model, ps, CacheConfig(mode="full", chunk_size=64)).tokens
        spec = run(tiny_model, ps, CacheConfig(mode="specache", k=4096, group=32, residual=16, chunk_size=64,
                                               store_dtype="fp32")).tokens
    finally:
        prepare_model(tiny_model)
    assert spec == full


@pytest.mark.parametrize("mode", ["specache", "exact"])
def test_bf16_prefill_without_the_native_kernel_keeps_the_limits_equal_to_full(tiny_model, reference, monkeypatch,
                                                                                mode):
    """bf16 prefill linears where the native bf16 attention kernel is missing (an ARM64 or AVX2 build on
    a CPU with bf16): the prefill attention is the exact torch path, whose pieces the guided layer must
    split as the full cache does (one past piece, then the chunk), since bf16 linears turn a float
    rounding of difference into bf16 ones. So the prefill's logits equal full's bit for bit, for
    specache with k >= context and for exact mode."""
    from engine.kvcache import guided
    from engine.kvcache.policies import full as full_module
    from engine.model.loading import prepare_model

    for module in (full_module, guided):
        monkeypatch.setattr(module, "bf16_prefill_attention", lambda *a, **k: None)
    ps, refs = reference
    prepare_model(tiny_model, torch.bfloat16)
    try:
        cfg = CacheConfig(mode=mode, k=4096, group=32, residual=16, chunk_size=64, store_dtype="fp32")
        for p, ref in zip(ps, refs):
            want = next(Engine(tiny_model, CacheConfig(mode="full", chunk_size=64)).teacher_forced(p, ref[:1]))
            got = next(Engine(tiny_model, cfg).teacher_forced(p, ref[:1]))
            assert torch.equal(got, want), len(p)
    finally:
        prepare_model(tiny_model)


@pytest.mark.parametrize("mode,prefetch", [("full", "current"), ("specache", "current"), ("specache", "speculative"),
                                           ("kivi", "current")])
def test_a_finished_row_leaves_the_batch(tiny_model, monkeypatch, mode, prefetch):
    """Row 1 of 3 meets its stop token early: the later passes feed 2 rows (steps.drop_finished moves
    row 2's state into row 1's slot) and every row's output is what it was without the stop token,
    cut at it."""
    from engine.generate import steps

    ps = prompts_of((150, 97, 260))
    config = CacheConfig(mode=mode, k=16, residual=32, group=32, sinks=4, chunk_size=64, prefetch=prefetch)
    look_back = {"no_repeat_ngram": 2, "repeat_penalty": 1.3}  # processors that read each row's answer so far
    free = run(tiny_model, ps, config, GenerationConfig(max_tokens=NEW, **look_back))
    stop = next(t for t in free.tokens[1][3:] if all(t not in row[:4] for row in free.tokens))  # row 1 stops
    fed = []
    real = steps.forward
    monkeypatch.setattr(steps, "forward", lambda model, cache, ids, rows, **kw: (
        kw.get("how", steps.PLAIN).is_prefill or fed.append(ids.shape[0])) and None or real(model, cache, ids, rows,
                                                                                              **kw))
    res = run(tiny_model, ps, config, GenerationConfig(max_tokens=NEW, stop_ids=(stop,), **look_back))
    assert res.tokens == [t[: t.index(stop)] if stop in t else t for t in free.tokens]
    assert fed[0] == 3 and fed[-1] < 3 and fed == sorted(fed, reverse=True)  # rows only ever leave


@pytest.mark.parametrize("native_on", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("config", [
    CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, store_dtype="fp32"),
    CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64, prefetch="current",
                store_dtype="fp32"),
    CacheConfig(mode="kivi", group=32, residual=16, sinks=4, chunk_size=64, store_dtype="fp32"),
    CacheConfig(mode="exact", k=16, group=32, residual=16, sinks=4, chunk_size=64, gamma=3)],
    ids=["speculative", "current", "kivi", "exact"])
def test_residual_window_in_the_store_equals_its_own_buffer(tiny_model, monkeypatch, config, native_on):
    """On the CPU with an fp32 store a guided layer's residual window is its host store's positions [qend, ...)
    (no buffer of its own, nothing shifted); on CUDA (and a 16-bit store) it has buffers of its own. Both hold the same floats: a batch of
    rows of different lengths (windows that end at different places; one near the store's end) and the
    shared-prefix copy give the same tokens, and teacher-forced logits bit for bit. The CPU layout
    allocates no residual slots."""
    import engine.kvcache
    import engine.kvcache.guided
    from engine.kvcache.transfer import Transfer

    if not native_on:
        monkeypatch.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
    prompts, gen = prompts_of((150, 97, 260)), GenerationConfig(max_tokens=20)
    (doc,) = prompts_of((200,), seed=5)
    shared = [doc + q for q in prompts_of((7, 12), seed=6)]
    forced = prompts_of((30,), seed=9)[0]

    def outputs():
        tokens = run(tiny_model, prompts, config, gen).tokens
        prefix = next(e for e in Engine(tiny_model, config).generate(shared, gen, shared_prefix=len(doc))
                      if isinstance(e, Finished)).tokens
        logits = torch.stack(list(Engine(tiny_model, config).teacher_forced(prompts[0], forced)))
        return tokens, prefix, logits

    in_store = outputs()
    monkeypatch.setattr(engine.kvcache, "Transfer", lambda device: Transfer(device, residual_in_store=False))
    own = outputs()
    assert in_store[0] == own[0] and in_store[1] == own[1]
    assert torch.equal(in_store[2], own[2])
    cpu = torch.device("cpu")
    own_cache = make_cache(tiny_model.config, config, 2, 400, torch.float32, cpu)
    monkeypatch.undo()
    in_cache = make_cache(tiny_model.config, config, 2, 400, torch.float32, cpu)
    own_layer = own_cache.layers[0]
    assert in_cache.layers[0].res_in_store and not own_layer.res_in_store and own_layer.res_k.shape[2] == 16 + 32 + 64
    assert own_cache.allocated_device_bytes() - in_cache.allocated_device_bytes() == \
        len(in_cache.layers) * 2 * own_layer.res_k[0].numel() * 4
