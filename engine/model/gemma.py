"""Gemma 2 and Gemma 3 (text) decoders of our own, beside engine.model.llama's: the same modules, parameter
names and floating-point operations as transformers' Gemma2ForCausalLM and Gemma3ForCausalLM (tests/test_gemma.py
checks the logits bit for bit), without importing transformers' modeling_utils. What differs from Llama's:
RMSNorm scales by (1 + w) in fp32 before casting back; the embedding is multiplied by sqrt(hidden) (cast to
the embedding's dtype, as transformers does: 55.5 in bf16 for 3072); attention scales by
query_pre_attn_scalar ** -0.5; four norms a layer (input, post-attention, pre- and post-feedforward); a
GELU-tanh MLP; per-layer sliding windows by layer_types. Gemma 2: attention-logit softcapping (passed to the
attention function as softcap) and a final-logit softcap. Gemma 3: an RMSNorm over each head's q and k, and
a rope per layer type (rope_parameters["sliding_attention"], the local base, and ["full_attention"]);
transformers' Gemma3Attention passes no softcap, nor does ours."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.configuration_utils import PreTrainedConfig

from engine.model import decode_norms
from engine.model import families
from engine.model.attention import ATTENTION_NAME
from engine.model.llama import (DYNAMIC_ROPE, CausalLM, DecoderModel, Output, apply_rope, attention_function,
                                kept_positions, rope_tables)


@dataclass(frozen=True)
class GemmaFamily:
    head_norms: bool  # Gemma 3: q_norm / k_norm
    rope_by_layer_type: bool  # Gemma 3: rope_parameters keyed by layer type
    passes_softcap: bool  # Gemma 2: the attention function gets softcap=config.attn_logit_softcapping
    required: tuple[str, ...]


GEMMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_activation", "rms_norm_eps", "tie_word_embeddings",
              "rope_parameters", "attention_bias", "query_pre_attn_scalar", "sliding_window", "layer_types",
              "final_logit_softcapping", "attn_logit_softcapping")  # what a Gemma family's config must hold


def why_not_gemma(config) -> str | None:
    """Why this Gemma config cannot run in our decoders (None: it can)."""
    family = families.spec(config.model_type, "gemma")
    missing = [key for key in family.required if not hasattr(config, key)]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    if config.hidden_activation != "gelu_pytorch_tanh":
        return f"activation {config.hidden_activation!r}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    for rope in rope_sets(config, family).values():
        if rope.get("rope_type", "default") in DYNAMIC_ROPE:
            return f"rope type {rope['rope_type']!r}"
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return "a partial rotary factor"
    return None


def rope_sets(config, family: GemmaFamily) -> dict[str | None, dict]:
    """Layer type -> its rope parameters (None: one rope for every layer, Gemma 2)."""
    if family.rope_by_layer_type:
        return {t: config.rope_parameters[t] for t in sorted(set(config.layer_types))}
    return {None: config.rope_parameters}


def inverse_frequencies(config, layer_type: str | None, rope: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as transformers' Gemma2/3RotaryEmbedding computes them."""
    with torch.device("cpu"):
        if rope.get("rope_type", "default") == "default":
            dim = config.head_dim
            return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {"layer_type": layer_type} if layer_type is not None else {}
        return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", **extra)


def gemma_attention_function(name: str):
    if name == "eager":  # transformers' Gemma modules fall back on their own eager function (softcap)
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        return eager_attention_forward
    return attention_function(name)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    _scale: tuple | None = None  # (weight, its version, 1 + weight in fp32): computed once per weight

    def scale(self) -> torch.Tensor:
        """1 + weight in fp32 (the same floats as computing it on each call), kept until the weight changes."""
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version: computed every call
            return 1.0 + w.float()
        if self._scale is None or self._scale[0] is not w or self._scale[1] != version:
            self._scale = (w, version, 1.0 + w.float())
        return self._scale[2]

    native_decode = False  # decode steps by engine.model.decode_norms' native call (set by use_decode_norms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_decode and (y := decode_norms.rms_norm(x, self.scale(), self.eps)) is not None:
            return y
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        out = out * self.scale()
        return out if out.dtype == x.dtype else out.type_as(x)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + self(h): a residual stream plus its branch's post-norm (one native call in a decode step)."""
        if self.native_decode and (y := decode_norms.rms_norm(h, self.scale(), self.eps, res=x)) is not None:
            return y
        return x + self(h)


class GemmaAttention(nn.Module):
    def __init__(self, config, family: GemmaFamily, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.softcap = {"softcap": config.attn_logit_softcapping} if family.passes_softcap else {}
        heads, kv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        if family.head_norms:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    native_decode = False  # q/k norms and ropes of a decode step by one native call each (use_decode_norms)

    def forward(self, x: torch.Tensor, mask, cos: torch.Tensor, sin: torch.Tensor, cache, kwargs: dict):
        shape = (*x.shape[:-1], -1, self.head_dim)  # x [b, T, hidden] -> q/k/v [b, H, T, D]
        q, k = self.q_proj(x), self.k_proj(x)
        norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else (None, None)
        done = self.native_decode and decode_norms.norm_rope(
            tuple((y, n.scale() if n is not None else None) for y, n in zip((q, k), norms)), self.head_dim,
            self.config.rms_norm_eps, cos, sin)  # (the q/k norms' eps)
        q, k = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if not done:
            if norms[0] is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attend = gemma_attention_function(self.config._attn_implementation)
        out, _ = attend(self, q, k, v, mask, dropout=0.0, scaling=self.scaling, sliding_window=self.window,
                        **self.softcap, **kwargs)  # [b, T, H, D]
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # transformers' GELUTanh: torch's gelu, approximate="tanh"
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, family: GemmaFamily, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(config, family, layer_idx)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, mask, cos, sin, cache, kwargs: dict) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), mask, cos, sin, cache, kwargs)
        x = self.post_attention_layernorm.add_to(x, h)
        return self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaCausalLM(CausalLM):
    """The causal LM of a model type whose family names the "gemma" decoder (engine.model.families), named as
    transformers names it (model.embed_tokens, model.layers, model.norm, lm_head); built on the meta device,
    filled by the loader; forward as engine.model.llama.CausalLM's."""

    def __init__(self, config):
        nn.Module.__init__(self)
        config._attn_implementation = config._attn_implementation or ATTENTION_NAME
        self.config, family = config, families.spec(config.model_type, "gemma")
        self.model = DecoderModel(config, family, GemmaDecoderLayer, GemmaRMSNorm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.device("cpu"):  # also inside the loader's meta-device build: a value (fp32, as transformers')
            self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.ropes = {}  # layer type (None: every layer) -> (inv_freq, attention scaling)
        for layer_type, rope in rope_sets(config, family).items():
            self.ropes[layer_type] = inverse_frequencies(config, layer_type, rope)
        self.rope_of_layer = [t if family.rope_by_layer_type else None for t in config.layer_types]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache=None,
                logits_to_keep: int | torch.Tensor = 0, use_cache: bool | None = None, attention_mask=None, **kwargs) -> Output:
        x = self.model.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)  # [b, T, hidden]
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(x.shape[1], device=x.device) + start)[None]
        tables = {t: rope_tables(inv, scale, position_ids, x.dtype) for t, (inv, scale) in self.ropes.items()}
        masks = {"full_attention": None, "sliding_attention": None}  # the engine's cache layers mask by length
        if self.config._attn_implementation != ATTENTION_NAME:  # transformers' functions need their masks
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            given = dict(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                         position_ids=position_ids)
            masks = {"full_attention": create_causal_mask(**given),
                     "sliding_attention": create_sliding_window_causal_mask(**given)}
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables[self.rope_of_layer[i]]
            x = layer(x, masks[self.config.layer_types[i]], cos, sin, cache, kwargs)
        x = self.model.norm(x)
        logits = self.lm_head(kept_positions(x, logits_to_keep))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return Output(logits)


def gemma_config(values: dict) -> PreTrainedConfig:
    """A converted Gemma GGUF's (or a folder's) config.json values -> our config (unchecked: why_not_gemma)."""
    config = PreTrainedConfig(**values)
    config.use_cache = values.get("use_cache", True)
    return config
