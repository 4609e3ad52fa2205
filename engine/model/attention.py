"""The attention function registered with transformers under the name "specache".

Stock Llama/Mistral/Qwen2 attention modules project and rotate q/k/v, call
`cache.update(...)`, then call this function; it hands the query to our cache layer,
which knows how its K/V are kept (exact, guide + fetched set, window)."""
from __future__ import annotations

from transformers import AttentionInterface

ATTENTION_NAME = "specache"  # the name our attention function is registered under



def specache_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kv_cache=None, **kwargs):
    """query [b, H, T, D] (key/value were already stored by cache.update) -> ([b, T, H, D], None)."""
    if kv_cache is None:
        raise RuntimeError("the specache attention needs kv_cache=<engine.kvcache.KVCache> in the forward call")
    layer = kv_cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    step = kv_cache.step
    step.compute = getattr(module, "specache_prefill_dtype", None)  # set by engine.model.loading.prepare_model
    return layer.attend(query, scale, step), None


AttentionInterface.register(ATTENTION_NAME, specache_attention)
