"""Shared fixtures: tiny randomly initialised GQA Llama models (fast, real code paths) and the
embedded SmolLM2 (slow tests only)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.model.loading import prepare_model

# SPECACHE_TEST_DEVICE=cuda runs the tiny-model engine tests on a GPU (scripts/gpu_check.py does)
TEST_DEVICE = os.environ.get("SPECACHE_TEST_DEVICE", "cpu")
# The native kernels everywhere they apply (not only where this CPU's calibration found them faster),
# so that every test exercises them; tests/test_calibrate.py tests the calibration itself.
os.environ.setdefault("SPECACHE_NATIVE_CALIBRATE", "0")


def kivi_guide_part(keys, values, qend: int, bits: int, group: int, value_group: int, sinks: int, r=None):
    """The KIVI references' guide region: positions [0, qend) of keys / values [b, H_kv, L, D] as
    dequantize(quantize(.)) of K R and V R rotated back by R^T (R [D, D] or None), the first sinks exact.
    -> (keys, values) [b, H_kv, L, D] with the positions from qend on untouched."""
    from engine.kvcache import quant

    kr, vr = keys[:, :, :qend], values[:, :, :qend]
    if r is not None:
        kr, vr = kr @ r, vr @ r
    kq = quant.dequantize_keys(quant.quantize_keys(kr, bits, group))
    vq = quant.dequantize_values(quant.quantize_values(vr, bits, value_group))
    if r is not None:
        kq, vq = kq @ r.T, vq @ r.T
    s = min(sinks, qend)
    kq[:, :, :s], vq[:, :, :s] = keys[:, :, :s], values[:, :, :s]
    return torch.cat([kq, keys[:, :, qend:]], dim=2), torch.cat([vq, values[:, :, qend:]], dim=2)


def tiny_config(vocab: int = 320, max_pos: int = 2048, layers: int = 3) -> LlamaConfig:
    """3 layers, 6 query heads sharing 2 KV heads (GQA group 3), head dim 32."""
    return LlamaConfig(vocab_size=vocab, hidden_size=192, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_tiny_model(seed: int = 0, **kwargs) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kwargs)).eval()
    # larger-than-default weights make the random model's attention peaky, like a trained one
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return prepare_model(model)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return make_tiny_model().to(TEST_DEVICE)


@pytest.fixture(scope="session")
def embedded_dir():
    """The converted embedded model folder (converts once per machine, ~20 s)."""
    from engine.model.loading import resolve_model_dir

    return resolve_model_dir(None)[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir):
    """A local HF folder: a tiny random Llama (1024-token window) with the real SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-model")
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    model = make_tiny_model(vocab=len(tok), max_pos=1024, layers=2)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for extra in ("chat_template.jinja",):
        if (embedded_dir / extra).exists() and not (out / extra).exists():
            shutil.copy(embedded_dir / extra, out / extra)
    return out
