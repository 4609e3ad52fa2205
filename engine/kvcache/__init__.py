"""The KV cache: one KVCache (engine.kvcache.base) holding one layer object per model layer, each of
its own class: the model's sliding-window layers keep their window (sliding.py), every other layer
the run's policy class (layer_classes). Policies: one module each in policies/ (full.py, specache.py,
kivi.py, window.py, exact.py), found by registry.discover and registered by name; `--cache` lists
them by their `listed` place. Shared below them: passes.py (Step, masks, the attention pieces),
base.py (the layer base class and the cache), sizes.py (formulas the planner uses too), quant.py /
guide.py (the 1/2-bit guide), host_store.py (host store and prefetch), transfer.py (a cache's transfer resources), fused.py (the native CPU
decode call)."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kvcache.base import CacheLayer, KVCache, ModelShape, Step, sliding_windows
from engine.kvcache.registry import POLICIES, discover, policy
from engine.kvcache.sliding import SlidingWindowLayer
from engine.kvcache.transfer import Transfer
from engine.kvcache.watch import GuideWatch

discover()  # every policy module of engine/kvcache/policies/ registers itself

__all__ = ["KVCache", "ModelShape", "Step", "POLICIES", "layer_classes", "make_cache", "policy", "sliding_windows"]


def layer_classes(model_config, cls: type[CacheLayer]) -> list[tuple[type[CacheLayer], int | None]]:
    """Per model layer, (its layer class, its sliding window): SlidingWindowLayer where the model
    attends within a window (engine.kvcache.base.sliding_windows), in every mode; elsewhere the
    policy's class `cls`."""
    return [(SlidingWindowLayer, w) if w is not None else (cls, None) for w in sliding_windows(model_config)]


def make_cache(model_config, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
               device: torch.device, cls: type[CacheLayer] | None = None) -> KVCache:
    """Build the cache: one layer per model layer of the class layer_classes gives it (CacheLayer.build);
    one Transfer (the prefetch worker and stream, on CUDA) shared by all of them and closed with the cache.
    cls: the policy's class, as the run resolved it (default: the one registered for config.mode;
    BadArgument for a mode not registered)."""
    cls = cls or policy(config.mode)
    shape = ModelShape.from_config(model_config)
    transfer = Transfer(device)
    layers = [layer.build(shape, config, batch, max_len, dtype, device, transfer, w)
              for layer, w in layer_classes(model_config, cls)]
    transfer.pin_host()  # CUDA: the exact store pinned at its bytes, or DoesNotFit before anything is pinned
    cache = KVCache(layers, shape, config, batch, max_len, device, transfer, cls)
    watched = [layer for layer in cache.policy_layers if getattr(layer, "watches", False) and layer.topk > 0]
    if watched:  # a run that notices when its guide is lost (engine/kvcache/watch.py)
        cache.watch = GuideWatch(watched)
        for layer in watched:
            layer.attach_watch(cache.watch)
    return cache
