"""The attention function the engine's models attend with, registered with transformers under the name
"specache" for models in transformers' own classes (engine.model.llama looks it up without transformers).

Stock attention modules (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3: engine.model.support) project
and rotate q/k/v, call `cache.update(...)`, then call this function with their own arguments; it
hands the query to our cache layer, which knows how its K/V are kept (exact, guide + fetched set,
a sliding window's ring). Every argument a module passes is either implemented here (scaling,
softcap, sliding_window) or refused (UnsupportedModel): the engine never silently attends
differently from the model."""
from __future__ import annotations

import sys

from engine.errors import UnsupportedModel

ATTENTION_NAME = "specache"  # the name our attention function is registered under

# arguments that do not change the attention of a causal decoder in eval mode (the positions are
# the cache's own, Step.positions; the mask is rebuilt by the cache layer from each row's length)
IGNORED = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "cache", "past_key_values"})


def check_arguments(module, kwargs: dict, window: int | None) -> float | None:
    """The softcap of this call, after checking that every argument the module passed is one the
    engine reproduces: sliding_window equal to the cache layer's window (window), dropout 0, a causal
    module, nothing else but IGNORED. Raises UnsupportedModel naming the model type and the argument."""
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    for name, value in kwargs.items():
        if name in IGNORED or value is None:
            continue
        if name == "dropout" and not value:
            continue
        if name == "is_causal" and value:
            continue
        if name in ("sliding_window", "softcap"):
            continue
        raise UnsupportedModel(f"model type '{model_type}' is not supported: its attention passes "
                               f"'{name}', which the engine does not implement")
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModel(f"model type '{model_type}' is not supported: bidirectional attention")
    passed = kwargs.get("sliding_window")
    if (passed or None) != window:
        raise UnsupportedModel(f"model type '{model_type}' is not supported: layer {module.layer_idx} attends "
                               f"with sliding_window={passed}, the cache was built for {window}")
    return kwargs.get("softcap")


def specache_attention(module, query, key, value, attention_mask, scaling=None, kv_cache=None, **kwargs):
    """query [b, H, T, D] (key/value were already stored by cache.update) -> ([b, T, H, D], None)."""
    if kv_cache is None:
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise UnsupportedModel(f"model type '{model_type}' is not supported: its attention module does not "
                               "pass the engine's cache to the attention function")
    layer = kv_cache.layers[module.layer_idx]
    softcap = check_arguments(module, kwargs, layer.window)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    step = kv_cache.step
    step.compute = getattr(module, "specache_prefill_dtype", None)  # set by engine.model.loading.prepare_model
    return layer.attend(query, scale, step, softcap=softcap), None


def register_with_transformers() -> None:
    """Register specache_attention with transformers' attention registry (importing transformers'
    modeling_utils: done only for a model in transformers' own classes; engine.model.llama needs none)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, specache_attention)


if "transformers.modeling_utils" in sys.modules:  # already paid for: models built by a caller find it
    register_with_transformers()
