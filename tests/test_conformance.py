"""Conformance: every architecture the engine accepts (engine.model.families) gives the model's
own greedy tokens, as transformers' eager `generate` does, in every mode where the output must be
exact: full, specache with k >= context (both prefetches) and exact; kivi equals a KIVI reference
that applies the model's own windows and softcap. Tiny random models (tests/tiny_archs.py) with
sliding windows narrower than the prompts; each run is a batch of two unequal prompts."""
from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from engine.config import CacheConfig, GenerationConfig
from engine.docstore.store import DocStore
from engine.generate.engine import Engine, Finished
from engine.generate.prefixes import DocStoreUse
from engine.generate.steps import forward, prefill
from engine.kvcache import make_cache, sliding_windows
from engine.kvcache.rotation import rotation_matrix
from engine.kvcache.sizes import quant_boundary
from engine.model.loading import prepare_model
from engine.model.families import checked
from tests.conftest import kivi_guide_part
from tests.tiny_archs import ARCHS, REFUSED, VOCAB, WINDOW, eager_greedy, save_model_dir, tiny_model

NEW = 24
LENGTHS = (300, 237)  # unequal prompts, both longer than the windows
# the exact store in the compute dtype: the exactness limits hold relative to the stored K/V (a 16-bit store, the
# CPU's default, rounds them: test_a_16_bit_store_rounds_what_k_at_context_attends)
BASE = dict(bits=2, group=32, residual=16, sinks=4, chunk_size=64, store_dtype="fp32")
MODES = {
    "full": dict(mode="full"),
    "specache": dict(mode="specache", k=1024, prefetch="speculative"),  # k >= context: every position exact
    "specache-current": dict(mode="specache", k=1024, prefetch="current"),
    "exact": dict(mode="exact", k=16, gamma=4),  # small k: drafts are rejected, the verification keeps it exact
}
WINDOWED = ("mistral-window", "qwen2-window", "gemma2", "gemma3", "phi3")
_CASES: dict[str, tuple] = {}


def prompts(lengths=LENGTHS, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 3, (n,), generator=g).tolist() for n in lengths]  # (the top ids: Gemma 3 image tokens)


def case(name: str):
    """(the prepared model, the prompts, transformers' eager greedy tokens for each), built once per architecture."""
    if name not in _CASES:
        model = tiny_model(name)
        ps = prompts()
        refs = [eager_greedy(model, p, NEW) for p in ps]
        _CASES[name] = (prepare_model(model), ps, refs)
    return _CASES[name]


def generate(model, ps, config: CacheConfig, store=None, **kwargs) -> Finished:
    events = Engine(model, config, store).generate(ps, GenerationConfig(max_tokens=NEW), **kwargs)
    return next(e for e in events if isinstance(e, Finished))


def test_every_checked_model_type_is_in_the_conformance_test():
    assert {tiny_model(n).config.model_type for n in ARCHS} == set(checked())


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "gemma2", "gemma3", "phi3"])
def test_the_windows_and_softcap_change_the_output(name):
    """The architectures' own features matter at these sizes: without them (the reference attention
    run as plain causal attention) the greedy tokens differ, so equality below means they are reproduced."""
    model, ps, refs = case(name)
    windows = sliding_windows(model.config)
    assert any(w == WINDOW for w in windows) and max(LENGTHS) > WINDOW
    plain = generate(model, ps, CacheConfig(mode="full", **BASE))
    assert plain.tokens == refs
    saved = {}
    def no_features(module, q, k, v, mask, **kwargs):  # what the engine did before: drop window and softcap
        kwargs.pop("sliding_window", None), kwargs.pop("softcap", None)
        rep = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                               is_causal=q.shape[2] > 1, scale=kwargs.get("scaling"))
        return out.transpose(1, 2), None
    AttentionInterface.register("no_features", no_features)
    impl = model.config._attn_implementation
    model.set_attn_implementation("no_features")
    try:
        ids = torch.tensor([ps[0]])
        saved = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0)[0, len(ps[0]):].tolist()
    finally:
        model.set_attn_implementation(impl)
    assert saved != refs[0]


# the second prefetch mode only where the attention differs (windows, softcap): elsewhere it is the code
# path tests/test_engine.py already checks on Llama (keeps this file's time down on 2 cores)
CASES = [(name, mode) for name in ARCHS for mode in MODES if mode != "specache-current" or name in WINDOWED]


@pytest.mark.parametrize("name,mode", CASES)
def test_greedy_tokens_equal_transformers_eager(name, mode):
    model, ps, refs = case(name)
    assert all(len(set(r)) > 1 for r in refs), "the random model should not emit one token over and over"
    result = generate(model, ps, CacheConfig(**{**BASE, **MODES[mode]}))
    assert result.tokens == refs


def test_a_16_bit_store_rounds_what_k_at_context_attends():
    """With a 16-bit store (bf16: the CPU's default) k >= context attends with every exact K/V past the residual
    window rounded to 16 bits: its logits leave full's by that rounding only, where the fp32 store's (what the
    exactness tests above set) equal them; an fp16 store (3 more mantissa bits; the torch path) leaves them by
    less. Teacher-forced with full's own tokens."""
    model, ps, refs = case("llama")
    forced = refs[0]

    def logits(**settings):
        config = CacheConfig(**{**BASE, **settings})
        return torch.stack(list(Engine(model, config).teacher_forced(ps[0], forced)))

    full = logits(mode="full")
    exact = logits(**MODES["specache-current"])
    gap = {kept: float((logits(**{**MODES["specache-current"], "store_dtype": kept}) - full).abs().max())
           for kept in ("bf16", "fp16")}
    torch.testing.assert_close(exact, full, rtol=1e-4, atol=1e-4)
    assert 1e-4 < gap["bf16"] < 0.02 * float(full.abs().max()) and gap["fp16"] < gap["bf16"], gap


@pytest.mark.parametrize("mode", ["full", "specache", "exact"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window"])
def test_document_store_hit_gives_the_models_tokens(name, mode, tmp_path):
    """A document prefix saved by one run and loaded by the next (its sliding layers' windows included)."""
    model, ps, refs = case(name)
    use = DocStoreUse(DocStore(tmp_path / "kv"), name)
    config = CacheConfig(**{**BASE, **MODES[mode]})
    miss = generate(model, ps[:1], config, use, prefixes=[250], labels=["doc"])
    hit = generate(model, ps[:1], config, use, prefixes=[250])
    assert miss.store[0]["hit"] is False and hit.store[0]["hit"] is True
    assert miss.tokens == hit.tokens == refs[:1]


class KiviWindowReference:
    """Plain KIVI over the model's own attention: exact K/V kept per layer; at a decode step of a global
    layer, positions below the quantization boundary are dequantize(quantize(.)) (sinks exact); a
    sliding layer attends exactly within its window; the scores are softcapped as the model asks. With a
    rotation R the guide part is dequantize(quantize(K R)) R^T (and V likewise): the same scores and
    output as rotating the queries in and the output back."""

    def __init__(self, bits, group, residual, sinks, rotation="none", outliers=0, chosen_from=0):
        self.bits, self.group, self.residual, self.sinks = bits, group, residual, sinks
        self.rotation = rotation
        self.outliers, self.chosen_from = outliers, chosen_from  # conftest.outlier_keys_reference
        self.k, self.v, self.length = {}, {}, 0

    def attention(self, module, q, k, v, mask, scaling=None, sliding_window=None, softcap=None, **kwargs):
        i = module.layer_idx
        self.k[i] = torch.cat([self.k[i], k], dim=2) if i in self.k else k
        self.v[i] = torch.cat([self.v[i], v], dim=2) if i in self.v else v
        keys, values = self.k[i], self.v[i]
        t, n = q.shape[2], keys.shape[2]
        qend = int(quant_boundary(torch.tensor(self.length), self.residual, self.group)) if t == 1 else 0
        if qend and sliding_window is None:
            keys, values = kivi_guide_part(keys, values, qend, self.bits, self.group, min(self.group, values.shape[-1]),
                                           self.sinks, rotation_matrix(self.rotation, keys.shape[-1]),
                                           self.outliers, self.chosen_from)
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = (q @ keys.transpose(-1, -2)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos, kpos = torch.arange(n - t, n)[:, None], torch.arange(n)[None, :]
        allowed = (kpos <= qpos) & ((kpos > qpos - sliding_window) if sliding_window else True)
        out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ values
        return out.transpose(1, 2), None


@pytest.mark.parametrize("name,bits,outliers", [("gemma2", 2, 0), ("gemma3", 2, 0), ("qwen2-window", 2, 0),
                                               ("llama", 2, 0), ("gemma3", 1, 4)])
def test_kivi_equals_the_kivi_reference(name, bits, outliers):
    model, ps, _ = case(name)
    p = ps[0]
    group, residual, sinks, steps = 32, 16, 4, 24
    config = CacheConfig(mode="kivi", bits=bits, group=group, residual=residual, sinks=sinks, chunk_size=64,
                         outliers=outliers, rotation="hadamard",  # set: the default's choice is per layer (auto)
                         store_dtype="fp32")  # (its prefill reads the past from the store)
    cache = make_cache(model.config, config, 1, 400, torch.float32, torch.device("cpu"))
    *_, logits = prefill(model, cache, p, 0, 64)
    chosen_from = int(quant_boundary(torch.tensor(64), residual, group))  # the first chunk's quantized keys
    ref = KiviWindowReference(bits, group, residual, sinks, config.guide_rotation,
                              outliers, chosen_from)
    AttentionInterface.register("kivi_window_reference", ref.attention)
    impl = model.config._attn_implementation
    crossed = 0
    try:
        with torch.inference_mode():
            model.set_attn_implementation("kivi_window_reference")
            ref_logits = model(torch.tensor([p]), position_ids=torch.arange(len(p))[None], use_cache=False).logits[0, -1]
            ref.length = len(p)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            token = int(ref_logits.argmax())
            for _ in range(steps):
                model.set_attn_implementation("kivi_window_reference")
                ref_logits = model(torch.tensor([[token]]), position_ids=torch.tensor([[ref.length]]),
                                   use_cache=False).logits[0, -1]
                model.set_attn_implementation(impl)
                ours = forward(model, cache, torch.tensor([[token]]), slice(0, 1))[0, -1]
                torch.testing.assert_close(ours, ref_logits, rtol=1e-3, atol=1e-3)
                crossed += int(quant_boundary(torch.tensor(ref.length + 1), residual, group)) != \
                    int(quant_boundary(torch.tensor(ref.length), residual, group))
                ref.length += 1
                token = int(ref_logits.argmax())
    finally:
        model.set_attn_implementation(impl)
        cache.close()
    assert crossed >= 1, "the test should cross a quantization boundary during decoding"


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_model_gives_one_error_line_and_the_model_exit_code(name, tmp_path):
    """A model whose attention the engine does not reproduce is refused at load, through the CLI: one
    `error:` line naming the model type and what is missing, the model-error exit code, nothing on stdout."""
    from typer.testing import CliRunner

    from engine.errors import ModelLoadError
    from specache_cli.app import app

    model = tiny_model(name)
    folder = save_model_dir(model, tmp_path / name)
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"w{i % 300 + 3}" for i in range(200)) + "\n")
    r = CliRunner().invoke(app, ["summarize", str(doc), "--model", str(folder), "--no-store", "--max-tokens", "4",
                                 "--quiet"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == ModelLoadError.exit_code and r.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert f"'{model.config.model_type}'" in lines[0] and REFUSED[name][2] in lines[0], lines[0]


def test_an_attention_argument_the_engine_does_not_implement_is_refused():
    from engine.errors import UnsupportedModel
    from engine.model.attention import check_arguments

    model, _, _ = case("gemma2")
    module = model.model.layers[0].self_attn
    assert check_arguments(module, {"sliding_window": WINDOW, "softcap": 4.0, "dropout": 0.0,
                                    "position_ids": torch.arange(3)}, WINDOW) == 4.0
    for kwargs, window, what in [({"s_aux": torch.zeros(4)}, None, "'s_aux'"),
                                 ({"sliding_window": WINDOW}, None, "sliding_window=48"),
                                 ({"dropout": 0.1}, None, "'dropout'")]:
        with pytest.raises(UnsupportedModel, match="'gemma2'.*" + what.replace("(", r"\(")):
            check_arguments(module, kwargs, window)
