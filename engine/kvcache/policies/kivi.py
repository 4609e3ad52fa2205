"""KIVI with a residual window (k = 0): attention reads the 1/2-bit guide, the sinks and the exact
recent window; nothing is fetched. SpeCache's k = 0 limit (a test)."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kvcache.base import ModelShape
from engine.kvcache.guided import GuidedLayer
from engine.kvcache.registry import register
from engine.kvcache.transfer import Transfer


@register("kivi")
class KiviLayer(GuidedLayer):
    listed = 2  # its place in --cache's list (engine.kvcache.registry)
    fixed_settings = {"k": 0}  # SpeCache's k = 0 limit: nothing is ever fetched

    def __init__(self, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device, transfer: Transfer):
        super().__init__(shape, config, batch, max_len, dtype, device, transfer, topk=0, use_guide=True,
                         residual=config.residual, group=config.group)
