"""Llama-family decoders of our own, for the run path: the same modules, parameter names and floating-point
operations as transformers' LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and
Phi3ForCausalLM (tests/test_llama.py checks the logits bit for bit), without importing transformers' modeling_utils, which
brings torch._dynamo, torch.distributed and sympy (~90 MB of a run's RSS, ~1 s of its start). GGUF models of
those architectures load into them (engine.model.loading); every other model, and the `hf` bench baseline (it
needs transformers' generate), loads into transformers' own classes. Attention is looked up by
config._attn_implementation as transformers does: the engine's function without importing transformers,
anything else (sdpa, eager, the fidelity probe) from transformers' registry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.configuration_utils import PreTrainedConfig

from engine.model import decode_norms, families
from engine.model.attention import ATTENTION_NAME, specache_attention

# rope types whose tables depend on the sequence (transformers' dynamic_rope_update rewrites them)
DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True)
class Family:
    """How one model type's decoder differs from Llama's (transformers' modeling_<type>.py)."""

    qkv_bias: Callable[[PreTrainedConfig], bool]
    o_bias: Callable[[PreTrainedConfig], bool]
    mlp_bias: Callable[[PreTrainedConfig], bool]
    head_norms: bool = False  # Qwen3: an RMSNorm over each head's q and k before RoPE
    windows: str = "none"  # sliding windows: "none"; "config": config.sliding_window on every layer (Mistral);
    #                        "layer_types": on the layers layer_types calls sliding_attention (Qwen2 / 3)
    required: tuple[str, ...] = ()  # config.json keys without which transformers' classes load it instead
    fused: bool = False  # Phi-3: one qkv_proj and one gate_up_proj (gate, then up) instead of q/k/v and gate/up


def flag(name: str) -> Callable[[PreTrainedConfig], bool]:
    """A Family bias rule: the config's own boolean `name`."""
    return lambda config: bool(getattr(config, name))


NO, YES = (lambda config: False), (lambda config: True)
STRUCTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters")


# transformers' LlamaConfig defaults, for keys a config.json leaves out (tests/test_llama.py compares); the other
# families take a config.json only with every key they read (what transformers writes, as for a converted GGUF)
LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                      max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                      pad_token_id=None, bos_token_id=1, eos_token_id=2, pretraining_tp=1,
                      tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, mlp_bias=False,
                      head_dim=None)


def family_config(values: dict) -> PreTrainedConfig:
    """A config.json's values -> a config with the attributes of transformers' config class, built on
    transformers' base class (the model types' own config classes import transformers' activations and,
    through them, the model loading machinery). A llama file's missing keys take LlamaConfig's defaults,
    and its rope_theta / rope_scaling (older files) become rope_parameters; other model types as given."""
    values = dict(values)
    if values.get("model_type") == "llama":
        values = {**LLAMA_DEFAULTS, **values}
        values["head_dim"] = values["head_dim"] or values["hidden_size"] // values["num_attention_heads"]
        values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
        if not values.get("rope_parameters"):
            rope = dict(values.pop("rope_scaling", None) or {})
            rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
            rope["rope_theta"] = values.pop("rope_theta", 10000.0)
            values["rope_parameters"] = rope
    config = PreTrainedConfig(**values)
    config.use_cache = values.get("use_cache", True)  # the base class keeps no use_cache of its own
    return config


def why_not_own(config) -> str | None:
    """Why this config cannot run in our decoders (None: it can): a model type no family of this decoder
    registers (engine.model.families), a key its family reads missing, an activation other than SiLU, a
    rope whose tables change with the sequence."""
    family = families.spec(getattr(config, "model_type", None), "llama")
    if family is None:
        return f"model type {getattr(config, 'model_type', None)!r}"
    missing = [key for key in family.required if not hasattr(config, key)]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in DYNAMIC_ROPE:
        return f"rope type {rope['rope_type']!r}"
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        return "a partial rotary factor"  # rope_tables rotates every channel
    return None


def layer_window(config, family: Family, layer: int) -> int | None:
    """The sliding window layer `layer` attends with (None: the whole past), as the model type's module sets it."""
    if family.windows == "config":
        return getattr(config, "sliding_window", None)
    if family.windows == "layer_types" and config.layer_types[layer] == "sliding_attention":
        return config.sliding_window
    return None


def attention_function(name: str):
    """The attention function registered under name (transformers' registry, imported only when needed)."""
    if name == ATTENTION_NAME:
        return specache_attention
    if name == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def rope_inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [D/2] fp32, attention scaling), as transformers' LlamaRotaryEmbedding computes them."""
    rope = config.rope_parameters
    with torch.device("cpu"):  # also inside the loader's meta-device build: these are values
        if rope.get("rope_type", "default") == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")


def rope_tables(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype):
    """positions [b, T] -> (cos, signed sin) [b, 1, T, D] in dtype, as apply_rope takes them: transformers'
    cos and sin tables, the first half of sin negated (made once per forward, not per layer)."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, H, T, D], cos and signed sin [b, 1, T, D] (rope_tables) -> transformers' x cos + rotate_half(x) sin,
    bit for bit: rotate_half(x) sin = (-x2 sin1, x1 sin2) = (x2 (-sin1), x1 sin2), the halves of x swapped
    (a roll by D / 2) times the signed sin (negation is exact), in 4 operations instead of 9."""
    return (x * cos) + (torch.roll(x, x.shape[-1] // 2, -1) * sin)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    native_decode = False  # decode steps by engine.model.decode_norms' native call (set by use_decode_norms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_decode and (y := decode_norms.rms_norm(x, self.weight, self.variance_epsilon)) is not None:
            return y
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config, family: Family, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.window = layer_window(config, family, layer_idx)
        self.passes_window = family.windows != "none"  # transformers' module passes sliding_window=...
        heads, kv, bias = config.num_attention_heads, config.num_key_value_heads, family.qkv_bias(config)
        self.split = (heads * self.head_dim, kv * self.head_dim)  # the query's and a key's share of qkv_proj
        if family.fused:
            self.qkv_proj = nn.Linear(config.hidden_size, (heads + 2 * kv) * self.head_dim, bias=bias)
        else:
            self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=bias)
            self.k_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=bias)
            self.v_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=family.o_bias(config))
        if family.head_norms:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    native_decode = False  # (q/k norms and) ropes of a decode step by one native call each (use_decode_norms)

    def forward(self, x: torch.Tensor, mask, cos: torch.Tensor, sin: torch.Tensor, cache, kwargs: dict) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)  # x [b, T, hidden] -> q/k/v [b, T, H, D] -> [b, H, T, D]
        if hasattr(self, "qkv_proj"):
            qkv, (nq, nk) = self.qkv_proj(x), self.split
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else (None, None)
        done = self.native_decode and decode_norms.norm_rope(
            tuple((y, n.weight if n is not None else None) for y, n in zip((q, k), norms)), self.head_dim,
            norms[0].variance_epsilon if norms[0] is not None else 0.0, cos, sin)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if not done and norms[0] is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if not done:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attend = attention_function(self.config._attn_implementation)
        window = {"sliding_window": self.window} if self.passes_window else {}
        out, _ = attend(self, q, k, v, mask, dropout=0.0, scaling=self.scaling, **window, **kwargs)  # [b, T, H, D]
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config, family: Family):
        super().__init__()
        size, inner, bias = config.hidden_size, config.intermediate_size, family.mlp_bias(config)
        if family.fused:
            self.gate_up_proj = nn.Linear(size, 2 * inner, bias=bias)
        else:
            self.gate_proj = nn.Linear(size, inner, bias=bias)
            self.up_proj = nn.Linear(size, inner, bias=bias)
        self.down_proj = nn.Linear(inner, size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * nn.functional.silu(gate))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, family: Family, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, family, layer_idx)
        self.mlp = MLP(config, family)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, masks: dict, cos, sin, cache, kwargs: dict) -> torch.Tensor:
        mask = masks["sliding" if self.self_attn.window else "full"]
        x = x + self.self_attn(self.input_layernorm(x), mask, cos, sin, cache, kwargs)
        return x + self.mlp(self.post_attention_layernorm(x))


def meta_embedding(config) -> nn.Embedding:
    """The token embedding on the meta device, without its init (nn.Embedding's normal_ on meta imports
    torch._dynamo): filled from the file afterwards."""
    return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                        _weight=torch.empty(config.vocab_size, config.hidden_size, device="meta"))


class DecoderModel(nn.Module):
    """model.{embed_tokens, layers, norm}, named as transformers names them: layer(config, family, i) per layer
    and a final norm(size, eps) (Gemma's: engine.model.gemma)."""

    def __init__(self, config, family, layer=None, norm=None):
        super().__init__()
        layer, norm = layer or DecoderLayer, norm or RMSNorm
        self.embed_tokens = meta_embedding(config)
        self.layers = nn.ModuleList(layer(config, family, i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Output:
    logits: torch.Tensor


def kept_positions(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """x [b, T, D] at the positions whose logits a pass asks for, as transformers reads logits_to_keep: the
    last logits_to_keep (an int; 0: all) or the positions of an index tensor (empty: none, as a prefill
    chunk before the last asks: engine.generate.forward)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return x[:, logits_to_keep]
    return x[:, -logits_to_keep:] if logits_to_keep else x


class CausalLM(nn.Module):
    """The causal LM of a model type whose family names the "llama" decoder (engine.model.families):
    model.{embed_tokens, layers, norm} and lm_head, named as transformers names them; built on the meta device (`with torch.device("meta")`), its parameters then
    given by the loader. forward takes what the engine's steps pass (input_ids, position_ids, cache,
    logits_to_keep; other keyword arguments go on to the attention function, as in transformers)
    -> Output(logits)."""

    def __init__(self, config):
        super().__init__()
        config._attn_implementation = config._attn_implementation or ATTENTION_NAME
        self.config = config
        self.model = DecoderModel(config, families.spec(config.model_type, "llama"))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, self.rope_scaling = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_attn_implementation(self, name: str) -> None:
        attention_function(name)  # an unknown name fails here, not at the next forward
        self.config._attn_implementation = name

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache=None,
                logits_to_keep: int | torch.Tensor = 0, use_cache: bool | None = None, attention_mask=None, **kwargs) -> Output:
        x = self.model.embed_tokens(input_ids)  # [b, T, hidden]
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(x.shape[1], device=x.device) + start)[None]
        cos, sin = rope_tables(self.inv_freq, self.rope_scaling, position_ids, x.dtype)
        masks = {"full": None, "sliding": None}  # the engine's cache layers mask by each row's length
        if self.config._attn_implementation != ATTENTION_NAME:  # transformers' functions need their masks
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            given = dict(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                         position_ids=position_ids)
            masks["full"] = create_causal_mask(**given)
            if any(layer.self_attn.window for layer in self.model.layers):
                masks["sliding"] = create_sliding_window_causal_mask(**given)
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        for layer in self.model.layers:
            x = layer(x, masks, cos, sin, cache, kwargs)
        x = self.model.norm(x)
        return Output(self.lm_head(kept_positions(x, logits_to_keep)))
