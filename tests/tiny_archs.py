"""Tiny random models of several transformers architectures (the conformance test's and the refusal
test's): small enough that a 300-token prompt and 24 greedy tokens take well under a second, with
sliding windows narrower than the prompt and a softcap low enough to change the attention."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

VOCAB = 320
WINDOW = 48  # sliding windows: narrower than the conformance prompts (300 tokens)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)

# name -> (config class, its overrides): each a model a user could point --model at
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
    "llama3-rope": ("LlamaConfig", dict(num_hidden_layers=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen2-window": ("Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, sliding_window=WINDOW, attn_logit_softcapping=4.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16)),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    # the multimodal wrapper real Gemma 3 checkpoints (4B and up) load as; text prompts only
    "gemma3-multimodal": ("Gemma3Config", dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16)),
}

# architectures the engine refuses (engine.model.support), with the feature its error line names
REFUSED: dict[str, tuple[str, dict, str]] = {
    "stablelm": ("StableLmConfig", dict(num_hidden_layers=2), "does not pass the engine's cache"),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1,
                                     sliding_window=WINDOW), "attention sinks (s_aux)"),
}


def tiny_config(name: str):
    """The transformers config of architecture `name` (ARCHS, or REFUSED)."""
    cls, extra = ARCHS[name] if name in ARCHS else REFUSED[name][:2]
    if cls == "Gemma3Config":  # a text config inside, a one-layer vision tower beside it
        text = {k: v for k, v in {**COMMON, **extra}.items() if k != "tie_word_embeddings"}
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                         image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                         eoi_token_index=VOCAB - 2)
    config = getattr(transformers, cls)(**{**COMMON, **extra})
    if cls == "Phi3Config":  # no GQA head_dim field: hidden / heads
        config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A random model of that architecture with peaky attention (q/k weights x 4, like a trained one)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            for proj in ("q_proj", "k_proj", "qkv_proj"):
                if hasattr(module, proj) and hasattr(module, "layer_idx"):
                    getattr(module, proj).weight.mul_(4.0)
    return model


def word_tokenizer():
    """A word-level tokenizer of VOCAB ids built locally (no hub): 'w3 w17 ...' <-> ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=1024)


def save_model_dir(model: torch.nn.Module, out: Path) -> Path:
    """A local Hugging Face folder of `model` with the word tokenizer (what --model PATH reads)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    word_tokenizer().save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == model.config.model_type
    return out


def eager_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own generate under eager attention (its DynamicCache, its masks): the reference."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    finally:
        model.set_attn_implementation(impl)
    return out[0, len(prompt):].tolist()
