"""The KV cache: one KVCache (engine.kvcache.base) holding one layer object per model layer: the
model's sliding-window layers keep their window (sliding.py), every other layer the policy
`CacheConfig.mode` names. Policies: full.py, specache.py, kivi.py, window.py, exact.py; each
registers itself (registry.py). Shared below them: base.py (Step, masks, the layer base class),
sizes.py (formulas the planner uses too), quant.py / guide.py (the 1/2-bit guide), transfer.py
(host store and prefetch), fused.py (the native CPU decode call)."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kvcache import exact, full, kivi, specache, window  # noqa: F401  (each registers its policy)
from engine.kvcache.base import KVCache, ModelShape, Step, sliding_windows
from engine.kvcache.registry import POLICIES
from engine.kvcache.sliding import SlidingWindowLayer
from engine.kvcache.transfer import Transfer

__all__ = ["KVCache", "ModelShape", "Step", "POLICIES", "make_cache", "sliding_windows"]


def make_cache(model_config, config: CacheConfig, batch: int, max_len: int,
               dtype: torch.dtype, device: torch.device) -> KVCache:
    """Build the cache: per model layer a SlidingWindowLayer where the model attends within a window
    (engine.kvcache.base.sliding_windows), else a layer of the configured policy; one Transfer (the
    prefetch worker and stream, on CUDA) shared by all of them and closed with the cache."""
    shape = ModelShape.from_config(model_config)
    layer_cls = POLICIES[config.mode]
    transfer = Transfer(device)
    layers = [SlidingWindowLayer(shape, config, batch, max_len, dtype, device, w) if w is not None
              else layer_cls(shape, config, batch, max_len, dtype, device, transfer)
              for w in sliding_windows(model_config)]
    return KVCache(layers, shape, config, batch, max_len, device, transfer)
