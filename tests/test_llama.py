"""engine.model.llama, the engine's own Llama classes, against transformers' LlamaForCausalLM with the
same weights: logits bit for bit (transformers' attention functions and the engine's), the engine's
tokens, the config's defaults; and a run of the CLI that imports none of transformers' modeling code."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig

from engine.model.llama import LLAMA_DEFAULTS, CausalLM, family_config, why_not_own
from engine.model.filling import own_config
from tests.conftest import logits_on_both_classes, tokens_on_both_classes

BASE = dict(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
WINDOWED = {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}  # layer 1 slides
VARIANTS = {  # name -> (transformers' class name prefix, config values beyond BASE)
    "llama-gqa": ("Llama", {}),
    "llama-llama3-rope": ("Llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope-tied-biases": ("Llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 2.0}, "tie_word_embeddings": True,
                                                "attention_bias": True, "mlp_bias": True}),
    "llama-mha": ("Llama", {"num_key_value_heads": 6}),
    "mistral": ("Mistral", {"sliding_window": None}),
    "mistral-window": ("Mistral", {"sliding_window": 32}),
    "qwen2": ("Qwen2", {}),
    "qwen2-window": ("Qwen2", WINDOWED),
    "qwen3": ("Qwen3", {}),
    "qwen3-biases-window": ("Qwen3", {"attention_bias": True, **WINDOWED}),
    "phi3": ("Phi3", {"sliding_window": None}),
    "phi3-window": ("Phi3", {"sliding_window": 32}),
}


def pair(variant: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' model, ours from its config.json's values, as a converted GGUF folder holds them)
    with the same random weights (every parameter moved off its initial value, cast to dtype)."""
    prefix, values = VARIANTS[variant]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**{**BASE, **values})
    stock = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # biases and norms away from their 0 / 1 initialisation
            p.data = p.data.to(dtype)
    with torch.device("meta"):
        own = CausalLM(family_config(config.to_dict()))
    own.load_state_dict(stock.state_dict(), assign=True)
    return stock, own.eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers_bit_for_bit(variant, attention):
    logits_on_both_classes(*pair(variant), attention)  # (90 tokens: beyond llama3-rope's original 64 positions)


def test_bf16_logits_equal_transformers():
    stock, own = pair("llama-llama3-rope", torch.bfloat16)
    ids = torch.randint(3, 320, (1, 40))
    stock.set_attn_implementation("sdpa")
    own.set_attn_implementation("sdpa")
    with torch.inference_mode():
        want, got = stock(input_ids=ids).logits, own(input_ids=ids).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("mode", ["full", "specache"])
@pytest.mark.parametrize("variant", ["llama-llama3-rope", "llama-linear-rope-tied-biases", "mistral-window",
                                     "qwen2-window", "qwen3-biases-window", "phi3-window"])
def test_engine_tokens_equal_on_both_classes(variant, mode):
    """The engine's attention through either class: the same greedy tokens, batched, chunked prefill."""
    tokens_on_both_classes(*pair(variant), mode)


@pytest.mark.parametrize("values", [
    {"model_type": "llama", **BASE, **VARIANTS["llama-linear-rope-tied-biases"][1]},
    {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "num_hidden_layers": 2},  # defaults
    {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8, "rope_theta": 500000.0,  # older files
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024}},
], ids=["full", "sparse", "legacy-rope"])
def test_config_has_llama_configs_values(values):
    """Every field of transformers' LlamaConfig (defaults included) has the same value in ours."""
    ours, theirs = family_config(dict(values)), LlamaConfig(**values)
    names = [f.name for f in dataclasses.fields(LlamaConfig)] if dataclasses.is_dataclass(LlamaConfig) \
        else list(LLAMA_DEFAULTS)
    assert set(LLAMA_DEFAULTS) <= set(names) | {"head_dim"}
    for name in names + ["rope_parameters", "model_type"]:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    assert ours.get_text_config() is ours


@pytest.mark.parametrize("change,why", [
    ({"model_type": "phi"}, "model type 'phi'"),
    ({"model_type": "mistral"}, "config.json lacks hidden_act, tie_word_embeddings, rope_parameters, sliding_window"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "a partial rotary factor"),
])
def test_what_our_llama_does_not_run_loads_in_transformers_classes(tmp_path, change, why):
    values = {"model_type": "llama", **BASE, **change}
    assert why_not_own(family_config(values)) == why
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert own_config(tmp_path) is None  # the loader then builds transformers' class
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **BASE}))
    assert own_config(tmp_path) is not None


HEAVY = ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor", "sympy")


@pytest.mark.slow
def test_a_run_imports_no_transformers_modeling(tmp_path):
    """`specache summarize` on the embedded model (our Llama) imports none of what transformers' modeling
    code brings (~90 MB of RSS, docs/results.md, "Memory"); --dtype and the result as a normal run."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The committee met on Tuesday. It approved the budget and adjourned. " * 30)
    code = ("import json, sys\n"
            "from specache_cli.app import app\n"
            f"try:\n    app(['summarize', {str(doc)!r}, '--max-tokens', '4', '--no-store', '--quiet', '--json'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["generated_tokens"] >= 1
    assert json.loads(out.stderr.strip().splitlines()[-1]) == []
