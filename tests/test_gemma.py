"""engine.model.gemma, the engine's own Gemma 2 and Gemma 3 text classes, against transformers' Gemma2ForCausalLM
and Gemma3ForCausalLM with the same weights: logits bit for bit (transformers' attention functions and the
engine's; sliding windows narrower than the prompt, softcaps that change the result), the engine's tokens on
both classes, and the configs our classes refuse."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.model.filling import own_config, own_model
from engine.model.gemma import GemmaCausalLM, gemma_config, why_not_gemma
from tests.conftest import logits_on_both_classes, tokens_on_both_classes

BASE = dict(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=2, eos_token_id=1,
            pad_token_id=0, rms_norm_eps=1e-6, sliding_window=32, query_pre_attn_scalar=24)
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
LINEAR_GLOBAL = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # as Gemma 3 4B and up
VARIANTS = {  # name -> (transformers' class name prefix, config values beyond BASE)
    "gemma3": ("Gemma3Text", {"layer_types": TYPES}),
    "gemma3-untied-linear-global-rope": ("Gemma3Text", {"layer_types": TYPES, "tie_word_embeddings": False,
                                                         "rope_parameters": LINEAR_GLOBAL}),
    "gemma3-pattern-biases": ("Gemma3Text", {"sliding_window_pattern": 2, "attention_bias": True}),
    "gemma2-softcaps": ("Gemma2", {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0}),
    "gemma2-no-softcap": ("Gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None,
                                     "layer_types": TYPES}),
}


def pair(variant: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' model, ours from its config.json's values) with the same random weights, every
    parameter moved off its initial value (norms off 0: (1 + w) scales), cast to dtype."""
    prefix, values = VARIANTS[variant]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**{**BASE, **values})
    cls = "Gemma3ForCausalLM" if prefix == "Gemma3Text" else f"{prefix}ForCausalLM"
    stock = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(torch.randn_like(p) * 0.05)
            p.mul_(1.0 if p.dim() == 1 else 4.0)  # peaky attention, logits beyond a softcap of 3
            p.data = p.data.to(dtype)
    own = gemma_config(json.loads(config.to_json_string()))
    assert why_not_gemma(own) is None
    with torch.device("meta"):
        own = own_model(own)
    assert isinstance(own, GemmaCausalLM)
    own.load_state_dict(stock.state_dict(), assign=True, strict=not own.config.tie_word_embeddings)
    if own.config.tie_word_embeddings:
        own.lm_head.weight = own.model.embed_tokens.weight
    return stock, own.eval()


ATTENTIONS = [(v, a) for v in VARIANTS for a in ("sdpa", "eager")
              if a == "eager" or not v.startswith("gemma2")]  # transformers' Gemma 2 refuses sdpa (softcap)


@pytest.mark.parametrize("variant,attention", ATTENTIONS)
def test_logits_equal_transformers_bit_for_bit(variant, attention):
    stock, own = pair(variant)
    got = logits_on_both_classes(stock, own, attention)  # (90 tokens: beyond the 32-token windows)
    if stock.config.final_logit_softcapping:
        assert got.abs().max() <= stock.config.final_logit_softcapping  # the cap applied...
        assert got.abs().max() > 0.9 * stock.config.final_logit_softcapping  # ...and changed something


def test_windows_and_softcap_change_the_logits():
    """The checks above could pass with windows or softcaps ignored on both sides: they must matter."""
    stock, own = pair("gemma2-softcaps")
    own.set_attn_implementation("eager")
    ids = torch.randint(3, 320, (1, 90))
    with torch.inference_mode():
        base = own(input_ids=ids).logits
        own.config.attn_logit_softcapping = None
        for layer in own.model.layers:
            layer.self_attn.softcap = {"softcap": None}
        uncapped = own(input_ids=ids).logits
        own.config.sliding_window = 1000
        for layer in own.model.layers:
            layer.self_attn.window = 1000 if layer.self_attn.window else None
        unwindowed = own(input_ids=ids).logits
    assert not torch.equal(base, uncapped) and not torch.equal(uncapped[:, 40:], unwindowed[:, 40:])
    assert torch.equal(uncapped[:, :32], unwindowed[:, :32])  # within the window: the same


@pytest.mark.parametrize("variant", ["gemma3", "gemma2-softcaps"])
def test_bf16_logits_equal_transformers(variant):
    stock, own = pair(variant, torch.bfloat16)
    ids = torch.randint(3, 320, (1, 40))
    attention = "eager" if variant.startswith("gemma2") else "sdpa"
    stock.set_attn_implementation(attention)
    own.set_attn_implementation(attention)
    with torch.inference_mode():
        want, got = stock(input_ids=ids).logits, own(input_ids=ids).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("mode", ["full", "specache"])
@pytest.mark.parametrize("variant", ["gemma3-untied-linear-global-rope", "gemma2-softcaps"])
def test_engine_tokens_equal_on_both_classes(variant, mode):
    """The engine's attention through either class: the same greedy tokens, batched, chunked prefill."""
    tokens_on_both_classes(*pair(variant), mode)


@pytest.mark.parametrize("change,why", [
    ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "bidirectional attention"),
    ({"layer_types": TYPES, "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                                   "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope type 'dynamic'"),
])
def test_what_our_gemma_does_not_run_loads_in_transformers_classes(tmp_path, change, why):
    values = json.loads(transformers.Gemma3TextConfig(**BASE).to_json_string())
    values.update(change)
    assert why_not_gemma(transformers.PreTrainedConfig(**values)) == why
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert own_config(tmp_path) is None  # the loader then builds transformers' class
    del values["query_pre_attn_scalar"]
    assert why_not_gemma(transformers.PreTrainedConfig(**values)).startswith("config.json lacks query_pre_attn_scalar")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_a_folder_of_safetensors_loads_into_our_classes_with_transformers_tokens(arch, tmp_path):
    """A Hugging Face folder (tests/tiny_archs: windows narrower than the prompt, Gemma 2's softcaps) runs in our
    classes and gives transformers' own greedy tokens (its generate, eager attention)."""
    from engine.model.llama import CausalLM
    from engine.model.loading import load_model
    from tests.tiny_archs import eager_greedy, save_model_dir, tiny_model

    stock = tiny_model(arch)
    loaded = load_model(str(save_model_dir(stock, tmp_path / arch)), device="cpu", dtype="float32")
    assert type(loaded.model) is (CausalLM if arch == "phi3" else GemmaCausalLM)
    prompt = torch.randint(3, 320, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    config = CacheConfig(mode="full", chunk_size=64)
    fin = next(e for e in Engine(loaded.model, config).generate([prompt], GenerationConfig(max_tokens=12))
               if isinstance(e, Finished))
    assert fin.tokens[0] == eager_greedy(stock, prompt, 12)
